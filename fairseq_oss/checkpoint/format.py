"""The checkpoint file: a ``torch.load``-able zip, written one record at a time.

Owns the bytes on disk and nothing else (no collectives, no fairseq). A checkpoint is the
zip that ``torch.save`` writes (``archive/data.pkl`` plus one ``archive/data/KEY`` record
per storage, 64-byte aligned), written with :mod:`zipfile` so that a record can be
*streamed*: the optimizer state arrives bucket by bucket from the other ranks and goes to
disk as it comes, and no process ever holds it whole. Two additions, both ignored by
``torch.load``:

* ``archive/fairseq_oss.json``, the manifest: per record, its size and the CRC32 of each
  ``CHUNK_BYTES`` chunk (computed while writing: no second read), and where each
  parameter's Adam state lies, so that a rank can read and verify only its own slice;
* the zip's own CRC32 fields are right, so ``unzip -t`` checks the file too.

Writing is durable: a locked temporary file in the target's directory, fsync, rename,
fsync of the directory (:mod:`fairseq_oss.checkpoint.files`). Until the rename, the previous
checkpoint of that name is untouched.
"""
import collections
import hashlib
import io
import json
import os
import pickle
import struct
import sys
import zipfile
import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from fairseq_oss.checkpoint import safe_load
from fairseq_oss.checkpoint.files import TemporaryFile, remove_stale_temporaries

CHUNK_BYTES = 1 << 20
MANIFEST = "fairseq_oss.json"
FORMAT = "fairseq-oss/1"
_PREFIX = "archive/"
_WRITER = f"fairseq-oss {__import__('fairseq_oss').__version__}"
_ALIGN = 64


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and the first problem."""


class OptimizerStateFile:
    """Stands in for ``last_optimizer_state`` between fairseq's load and the optimizer's
    ``load_state_dict``: the checkpoint's path and how to read it. It is no dict, so that
    fairseq's ``broadcast_object`` passes it on as it is; it answers ``in`` and ``[]`` for
    the state's small top-level entries other than ``state`` and ``param_groups`` (e.g.
    ``loss_scale``, which fairseq's FP16Optimizer reads)."""

    def __init__(self, path, verify=True, shared_fs=True, extras=None):
        self.path, self.verify, self.shared_fs = path, verify, shared_fs
        self.extras = dict(extras or {})

    def __contains__(self, key):
        return key in self.extras

    def __getitem__(self, key):
        return self.extras[key]

    def get(self, key, default=None):
        return self.extras.get(key, default)

    def __repr__(self):
        return f"OptimizerStateFile({self.path!r})"


@dataclass(frozen=True)
class StorageRef:
    """A storage written as record ``data/KEY`` before the pickle that refers to it."""

    key: str
    dtype: torch.dtype
    numel: int


class StreamedTensor:
    """Stands in, in the object given to :meth:`CheckpointWriter.finish`, for a tensor
    whose bytes are already in the file: it pickles exactly as a tensor that views
    ``ref`` at element ``offset`` does, so ``torch.load`` returns a plain tensor."""

    __slots__ = ("ref", "offset", "shape", "stride")

    def __init__(self, ref: StorageRef, offset: int, shape, stride=None):
        self.ref, self.offset, self.shape = ref, offset, tuple(shape)
        if stride is None:  # contiguous
            contiguous, acc = [], 1
            for n in reversed(self.shape):
                contiguous.append(acc)
                acc *= n
            stride = reversed(contiguous)
        self.stride = tuple(stride)

    def __reduce_ex__(self, protocol):
        return (
            torch._utils._rebuild_tensor_v2,
            (self.ref, self.offset, self.shape, self.stride, False, collections.OrderedDict()),
        )


class RecordPlan:
    """One record of a save as one rank sees it: its size, and the parts of it that this
    rank writes, in order, each ``(byte position in the record, tensor)``, the tensor on
    the CPU or a function that returns it (made when written: bounded memory). The same
    ``nbytes`` on every rank; the ranks' parts tile the record."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, nbytes: int, parts):
        self.nbytes, self.parts = nbytes, parts

    def pieces(self):
        """This rank's ``(byte position, bytes)``, one part at a time."""
        for pos, part in self.parts:
            yield pos, _bytes_of(part() if callable(part) else part)


def _storage_type(dtype: torch.dtype):
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


def _gf2_times(mat: List[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: List[int]) -> List[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def _zero_byte_operators(count: int = 48) -> List[List[int]]:
    """Operator k appends 2**k zero bytes to a CRC32 register (zlib's crc32_combine)."""
    one_bit = [0xEDB88320] + [1 << n for n in range(31)]
    op = _gf2_square(_gf2_square(_gf2_square(one_bit)))  # 8 bits: one zero byte
    ops = [op]
    for _ in range(count - 1):
        op = _gf2_square(op)
        ops.append(op)
    return ops


_ZERO_OPS = _zero_byte_operators()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(_ZERO_OPS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


class _ChunkedCrc:
    """CRC32 of each CHUNK_BYTES chunk of a stream, in one pass; the whole stream's CRC
    is combined from them (so the zip's CRC costs no second pass)."""

    def __init__(self):
        self.crcs: List[int] = []
        self._crc = 0
        self._filled = 0
        self.nbytes = 0

    def update(self, data: memoryview) -> None:
        pos = 0
        while pos < len(data):
            take = min(len(data) - pos, CHUNK_BYTES - self._filled)
            self._crc = zlib.crc32(data[pos : pos + take], self._crc)
            self._filled += take
            pos += take
            if self._filled == CHUNK_BYTES:
                self.crcs.append(self._crc)
                self._crc, self._filled = 0, 0
        self.nbytes += len(data)

    def close(self) -> List[int]:
        if self._filled:
            self.crcs.append(self._crc)
            self._crc, self._filled = 0, 0
        return self.crcs

    def whole(self) -> int:
        return combine_chunk_crcs(self.crcs, self.nbytes)


def combine_chunk_crcs(crcs: List[int], nbytes: int) -> int:
    """The CRC32 of ``nbytes`` bytes from the CRCs of their CHUNK_BYTES chunks."""
    crc = 0
    for i, c in enumerate(crcs):
        crc = crc32_combine(crc, c, min(CHUNK_BYTES, nbytes - i * CHUNK_BYTES))
    return crc


def _bytes_of(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


class CheckpointWriter:
    """Writes one checkpoint. Use: :meth:`stream` records (optional), then :meth:`finish`
    with the object to pickle; or :meth:`abort`. Only the writing rank creates one."""

    def __init__(self, directory: str):
        self.directory = directory
        remove_stale_temporaries(directory)
        self._tmp = TemporaryFile(directory)
        self.tmp_path = self._tmp.path
        self._file = self._tmp.file
        self._zip = zipfile.ZipFile(self._file, "w", zipfile.ZIP_STORED, allowZip64=True)
        self._open_streams = []
        self._reserved: Dict[str, zipfile.ZipInfo] = {}
        self.reserved_records = 0  # records other writers filled in (parallel saves)
        self._next_key = 0
        self.records: Dict[str, Dict] = {}
        self.extra_manifest: Dict = {}

    def new_key(self) -> str:
        key = str(self._next_key)
        self._next_key += 1
        return key

    def _zipinfo(self, name: str) -> zipfile.ZipInfo:
        info = zipfile.ZipInfo(_PREFIX + name, date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        # local header (30) + name + zip64 extra (20) + our padding field (4 + pad)
        header = 30 + len(info.filename.encode()) + 20 + 4
        pad = (-(self._file.tell() + header)) % _ALIGN
        info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB", as torch pads
        return info

    def stream(self, name: str):
        """A writable record: ``with writer.stream('data/0') as w: w.write(tensor)``."""
        return _RecordStream(self, name)

    def reserve(self, name: str, nbytes: int) -> int:
        """Lay out record ``name`` of ``nbytes`` whose bytes other writers put in place
        (``os.pwrite`` at the offset returned, through their own file descriptors): here
        the file only gets the record's header and a hole. The header is rewritten, and
        the record enters the manifest, once :meth:`fill_reserved` has its chunk CRCs;
        the result is byte for byte what :meth:`stream` would have written."""
        out = self._zip.open(self._zipinfo(name), "w", force_zip64=True)
        offset = out._fileobj.tell()
        out._file_size = out._compress_size = nbytes
        out._fileobj.seek(nbytes, os.SEEK_CUR)
        out.close()  # a header with CRC 0 for now; the record is in the zip's directory
        self._reserved[name] = self._zip.NameToInfo[_PREFIX + name]
        self.reserved_records += 1
        return offset

    def fill_reserved(self, name: str, chunk_crcs: List[int]) -> None:
        """Record ``name``'s bytes are in place: enter its chunk CRCs in the manifest and
        its whole CRC in its header (and in the zip's directory, written at the end)."""
        info = self._reserved.pop(name)
        info.CRC = combine_chunk_crcs(chunk_crcs, info.file_size)
        end = self._file.tell()
        self._file.seek(info.header_offset)
        self._file.write(info.FileHeader(True))
        self._file.seek(end)
        self.records[name] = {"nbytes": info.file_size, "crc32": list(chunk_crcs)}

    def write_record(self, name: str, data) -> None:
        with self.stream(name) as w:
            w.write(data)

    def finish(self, obj, path: str) -> None:
        """Pickle ``obj`` (tensors become records, :class:`StreamedTensor` refer to
        streamed ones), write the manifest, and commit the file durably at ``path``."""
        if self._reserved:
            raise CheckpointError(f"records {sorted(self._reserved)} were reserved but never filled")
        storages: Dict[str, torch.UntypedStorage] = {}
        ids: Dict[int, str] = {}

        def persistent_id(o):
            if isinstance(o, StorageRef):
                return ("storage", _storage_type(o.dtype), o.key, "cpu", o.numel)
            if isinstance(o, torch.storage.TypedStorage):
                untyped = o._untyped_storage
                key = ids.get(untyped._cdata)
                if key is None:
                    key = ids[untyped._cdata] = self.new_key()
                    storages[key] = untyped
                return ("storage", getattr(torch, o._pickle_storage_type()), key, "cpu", o._size())
            if torch.is_storage(o):
                raise TypeError("untyped storages are not supported in checkpoints")
            return None

        class Pickler(pickle.Pickler):
            def persistent_id(self, o):
                return persistent_id(o)

        buf = io.BytesIO()
        Pickler(buf, protocol=2).dump(obj)
        self.write_record("data.pkl", buf.getvalue())
        self.write_record(".format_version", b"1")
        self.write_record(".storage_alignment", str(_ALIGN).encode())
        self.write_record("byteorder", sys.byteorder.encode())
        for key, storage in storages.items():
            t = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            self.write_record(f"data/{key}", t)
        self.write_record("version", b"3\n")
        manifest = {"format": FORMAT, "chunk_bytes": CHUNK_BYTES, "records": self.records, "writer": _WRITER,
                    **self.extra_manifest}
        self.write_record(MANIFEST, json.dumps(manifest, sort_keys=True).encode())
        self._zip.close()
        self._tmp.commit(path)

    def abort(self) -> None:
        """Throw the file away. Never raises: it runs while another error (a failed
        collective, a full disk, Ctrl-C) is on its way up, and that error is the one the
        user must see. A record may be half written: the zip is not finished (no
        directory is written to a file about to be removed), only closed."""
        for stream in self._open_streams:
            io.BufferedIOBase.close(stream)  # closed, without zipfile's bookkeeping
        self._open_streams.clear()
        self._zip._writing = False
        self._zip.fp = None  # ZipFile.close() and __del__ then write nothing
        self._tmp.discard()


class _RecordStream:
    """One record being written. The bytes go straight to the file; the CRCs are computed
    once, here, per chunk (the zip's own CRC is combined from them at close, instead of
    :mod:`zipfile` computing it in a second pass)."""

    def __init__(self, writer: CheckpointWriter, name: str):
        self.writer, self.name = writer, name
        self._crc = _ChunkedCrc()
        self.failed = False

    def __enter__(self):
        self._out = self.writer._zip.open(self.writer._zipinfo(self.name), "w", force_zip64=True)
        self.writer._open_streams.append(self._out)
        return self

    def write(self, data) -> None:
        if isinstance(data, torch.Tensor):
            data = _bytes_of(data)
        elif isinstance(data, (bytes, bytearray)):
            data = memoryview(data)
        try:
            self._crc.update(data)
            # zipfile's _ZipWriteFile.write without its crc32 (stored records: no compressor)
            self._out._file_size += len(data)
            self._out._compress_size += len(data)
            self._out._fileobj.write(data)
        except BaseException:
            self.failed = True
            raise

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None or self.failed:
            # Left open, out of the manifest: the writer is to be aborted, and closing
            # the record could only raise over the error that got us here.
            return False
        crcs = self._crc.close()
        self._out._crc = self._crc.whole()
        self._out.close()
        self.writer._open_streams.remove(self._out)
        self.writer.records[self.name] = {"nbytes": self._crc.nbytes, "crc32": crcs}
        return False


# ---------------------------------------------------------------------- reading


class CheckpointReader:
    """Opens a checkpoint for sliced reads: record offsets, the manifest (None for a file
    that ``torch.save`` wrote) and CRC verification of byte ranges."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._zip = torch._C.PyTorchFileReader(path)
        except Exception as e:  # truncated, not a zip, ...
            raise CheckpointError(f"{path}: not a readable checkpoint ({_first_line(e)})") from None
        records = self._zip.get_all_records()
        self.manifest: Optional[Dict] = None
        if MANIFEST in records:
            self.manifest = json.loads(bytes(self._zip.get_record(MANIFEST)).decode())
            if self.manifest.get("format") != FORMAT:
                raise CheckpointError(f"{path}: unknown fairseq-oss format {self.manifest.get('format')!r}")
        self._verified = set()
        self._zip_crcs: Optional[Dict[str, int]] = None

    def record_offset(self, name: str) -> int:
        return self._zip.get_record_offset(name)

    def verify(self, name: str, start: int = 0, end: Optional[int] = None) -> None:
        """Check the CRC of every chunk of record ``name`` that bytes ``[start, end)`` touch.
        No-op without a manifest.

        Raises:
            CheckpointError: on a mismatch or a record shorter than recorded.
        """
        if self.manifest is None:
            return
        meta = self.manifest["records"].get(name)
        if meta is None:
            raise CheckpointError(f"{self.path}: record {name} is missing from the manifest")
        chunk = self.manifest["chunk_bytes"]
        end = meta["nbytes"] if end is None else end
        if end <= start:
            return
        offset = self.record_offset(name)
        with open(self.path, "rb") as f:
            for c in range(start // chunk, (end - 1) // chunk + 1):
                if (name, c) not in self._verified:
                    self._checked_chunk(f, name, meta, offset, c)

    def _checked_chunk(self, f, name: str, meta: Dict, offset: int, c: int) -> bytes:
        """Chunk ``c`` of record ``name`` (at file ``offset``), read and CRC-checked."""
        chunk = self.manifest["chunk_bytes"]
        want = min(chunk, meta["nbytes"] - c * chunk)
        data = os.pread(f.fileno(), want, offset + c * chunk)
        if len(data) != want or zlib.crc32(data) != meta["crc32"][c]:
            raise CheckpointError(
                f"{self.path}: checksum mismatch in record {name}, bytes "
                f"{c * chunk}-{c * chunk + want} (the file is corrupted or truncated)"
            )
        self._verified.add((name, c))
        return data

    def read_into(self, name: str, start: int, end: int, out: torch.Tensor, verify: bool = True) -> None:
        """Read bytes ``[start, end)`` of record ``name`` into the contiguous CPU tensor
        ``out``, reading chunk by chunk; with ``verify`` and a manifest, each chunk's CRC
        is checked on the bytes read (no second read). Memory: one chunk.

        Raises:
            CheckpointError: on a checksum mismatch or a short read.
        """
        dst = memoryview(out.view(torch.uint8).numpy()).cast("B")
        if len(dst) != end - start:
            raise ValueError(f"read_into: {end - start} bytes into a buffer of {len(dst)}")
        offset = self.record_offset(name)
        meta = (self.manifest or {}).get("records", {}).get(name) if verify else None
        if verify and self.manifest is not None and meta is None:
            raise CheckpointError(f"{self.path}: record {name} is missing from the manifest")
        chunk = self.manifest["chunk_bytes"] if meta is not None else max(end - start, 1)
        with open(self.path, "rb") as f:
            pos = start
            while pos < end:
                c = pos // chunk
                c_start, c_end = c * chunk, min((c + 1) * chunk, meta["nbytes"] if meta else end)
                hi = min(end, c_end)
                if meta is not None and (name, c) not in self._verified:
                    data = self._checked_chunk(f, name, meta, offset, c)
                    dst[pos - start : hi - start] = data[pos - c_start : hi - c_start]
                else:
                    n = os.preadv(f.fileno(), [dst[pos - start : hi - start]], offset + pos)
                    if n != hi - pos:
                        raise CheckpointError(f"{self.path}: record {name} is truncated")
                pos = hi

    def zip_crc(self, name: str) -> int:
        """The zip's own CRC32 of record ``name`` (``data.pkl``, ``data/KEY``), which every
        zip checkpoint has (``torch.save``'s too)."""
        if self._zip_crcs is None:
            try:
                with zipfile.ZipFile(self.path) as z:
                    self._zip_crcs = {i.filename.split("/", 1)[-1]: i.CRC for i in z.infolist()}
            except (zipfile.BadZipFile, OSError) as e:
                raise CheckpointError(f"{self.path}: not a readable checkpoint ({e})") from None
        crc = self._zip_crcs.get(name)
        if crc is None:
            raise CheckpointError(f"{self.path}: record {name} is missing from the zip's directory")
        return crc

    def check_zip_crc(self, name: str, crc: int, what: str = "") -> None:
        """Raise unless ``crc`` (of the bytes read from record ``name``, all of them) is the
        zip's CRC32 of that record; ``what`` names what the record holds."""
        if crc != self.zip_crc(name):
            raise CheckpointError(f"{self.path}: zip CRC32 mismatch in record {name}{what} (the file is corrupted)")

    def verify_bytes(self, name: str, data: bytes) -> None:
        """Check ``data``, the whole of record ``name`` as read: against the manifest's
        chunk CRCs where the file has one, else against the zip's CRC32."""
        if self.manifest is not None:
            self.verify(name)
        else:
            self.check_zip_crc(name, zlib.crc32(data))

    def verify_all_except(self, skip) -> None:
        """Verify every record listed in the manifest but those in ``skip``."""
        if self.manifest is None:
            return
        for name in self.manifest["records"]:
            if name not in skip:
                self.verify(name)


def _first_line(e: BaseException) -> str:
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return line.split(". This is an internal miniz error")[0]  # torch's advice follows it


class MappedPages:
    """The pages of a file mapping that hold some of its tensors (``torch.load(mmap=True)``
    maps the whole file once; each tensor views part of it). A page of the mapping that a
    reader touched counts in the process's resident memory for as long as the mapping
    lives; :meth:`release` hands the touched pages back (``madvise(MADV_DONTNEED)``), so a
    reader that copies the tensors out one at a time holds about one tensor's pages, not
    all of them. Released pages are read again from the file if touched later: the
    tensors keep their values, *provided nobody wrote to them* (a private mapping's written
    pages would revert to the file's bytes). Only for tensors that are read, never written,
    such as a checkpoint's model weights on their way into the model. No-op off Linux."""

    _MADV_DONTNEED = 4

    def __init__(self, tensors):
        page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        ranges = []
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() and t.device.type == "cpu":
                ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        self.start = self.end = 0
        if ranges:
            # inward to whole pages: a page partly outside the tensors is not ours to drop
            self.start = -(-min(lo for lo, _ in ranges) // page) * page
            self.end = max(hi for _, hi in ranges) // page * page
        self._madvise = _libc_madvise()

    @property
    def nbytes(self) -> int:
        return max(0, self.end - self.start)

    def release(self) -> None:
        if self._madvise is not None and self.nbytes:
            self._madvise(self.start, self.nbytes, self._MADV_DONTNEED)


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def load_mmap(path: str):
    """``torch.load`` with tensors mapped from the file, not read: a tensor's pages are
    read when touched; ``weights_only`` (no code from the file runs) unless the user
    trusts files (:mod:`fairseq_oss.checkpoint.safe_load`). Raises CheckpointError naming the file
    (and, for a refused file, the types it holds) on failure."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=not safe_load.trusted())
    except Exception as e:
        raise CheckpointError(safe_load.refusal(path, e) or f"{path}: cannot be loaded ({_first_line(e)})") from None


def fingerprint(path: str) -> str:
    """A digest of the zip's central directory: every record's name, size and CRC32 (for
    a fairseq-oss file that includes the manifest, which holds every chunk's CRC). Two
    files with the same fingerprint hold the same bytes, whoever wrote them; reading it
    costs the directory only.

    Raises:
        CheckpointError: if the file is not a readable zip.
    """
    try:
        with zipfile.ZipFile(path) as z:
            entries = [(i.filename, i.file_size, i.CRC) for i in z.infolist()]
    except (OSError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{path}: not a readable checkpoint ({_first_line(e)})") from None
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


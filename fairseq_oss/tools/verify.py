"""``fairseq-oss verify FILE...``: every record checked against its checksums, chunk by
chunk (one chunk in memory): this package's per-chunk CRCs where the file has a manifest,
else the zip's own CRC32 of each record (a stock ``torch.save`` file)."""
import os
import sys
import zipfile
import zlib

from fairseq_oss.checkpoint.format import CheckpointError, CheckpointReader
from fairseq_oss.checkpoint.index import CheckpointIndex
from fairseq_oss.tools.report import Progress, human_bytes

CHUNK = 1 << 20


class Damage(Exception):
    """A record that does not match its checksum: the record and byte range."""

    def __init__(self, record, start, end, what):
        super().__init__(what)
        self.record, self.start, self.end, self.what = record, start, end, what


def _check_manifest(path, reader: CheckpointReader, progress: Progress):
    meta = reader.manifest
    chunk = meta["chunk_bytes"]
    with open(path, "rb") as f:
        for name, rec in meta["records"].items():
            offset = reader.record_offset(name)
            for c, crc in enumerate(rec["crc32"]):
                want = min(chunk, rec["nbytes"] - c * chunk)
                data = os.pread(f.fileno(), want, offset + c * chunk)
                if len(data) != want:
                    raise Damage(name, c * chunk, c * chunk + want, "truncated")
                if zlib.crc32(data) != crc:
                    raise Damage(name, c * chunk, c * chunk + want, "checksum mismatch")
                progress.update(want)


def _check_zip_crcs(path, progress: Progress):
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            name = info.filename.split("/", 1)[1] if "/" in info.filename else info.filename
            crc, done = 0, 0
            with z.open(info) as f:
                f._expected_crc = None  # we check it ourselves, to say where
                while True:
                    data = f.read(CHUNK)
                    if not data:
                        break
                    crc = zlib.crc32(data, crc)
                    done += len(data)
                    progress.update(len(data))
            if done != info.file_size:
                raise Damage(name, done, info.file_size, "truncated")
            if crc != info.CRC:
                raise Damage(name, 0, info.file_size, "zip CRC32 mismatch")


def verify_file(path) -> str:
    """A line saying the file is intact. Raises CheckpointError naming the first
    problem (the record, its bytes and the tensors stored there)."""
    try:
        index = CheckpointIndex(path)
    except CheckpointError:
        if not os.path.isfile(path):
            raise  # missing, a directory: the index said so
        index = None  # a damaged pickle: the record checks below say where
    reader = index.reader if index is not None else CheckpointReader(path)  # raises for no zip checkpoint
    manifest = reader.manifest
    total = sum(r["nbytes"] for r in manifest["records"].values()) if manifest else _zip_total(path)
    progress = Progress(f"verify {path}", total)
    try:
        if manifest:
            _check_manifest(path, reader, progress)
        else:
            _check_zip_crcs(path, progress)
    except Damage as d:
        tensors = index.tensors_in(d.record, d.start, d.end) if index and d.record.startswith("data/") else []
        where = f" (holds {', '.join(tensors[:3])}{', ...' if len(tensors) > 3 else ''})" if tensors else ""
        raise CheckpointError(f"{path}: {d.what} in record {d.record}, bytes {d.start}-{d.end}{where}") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(f"{path}: not a readable checkpoint ({e})") from None
    finally:
        progress.close()
    if index is None:
        raise CheckpointError(f"{path}: its records match their checksums, but its pickle cannot be read")
    if manifest:
        return f"{path}: intact ({len(manifest['records'])} records, {human_bytes(total)} checked against per-chunk CRC32s)"
    return (f"{path}: intact as far as can be told: no fairseq-oss checksums (written by torch.save); "
            f"the zip's CRC32 of each record matches ({human_bytes(total)})")


def _zip_total(path):
    try:
        with zipfile.ZipFile(path) as z:
            return sum(i.file_size for i in z.infolist())
    except (zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(f"{path}: not a readable checkpoint ({e})") from None


def run(args) -> int:
    bad = 0
    for path in args.files:
        try:
            print(verify_file(path))
        except CheckpointError as e:
            print(f"fairseq-oss verify: {e}", file=sys.stderr)
            bad += 1
    return 1 if bad else 0

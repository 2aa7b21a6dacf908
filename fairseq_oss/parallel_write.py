"""Every rank writes its own shard of the Adam state into the one checkpoint file.

Owns the parallel alternative to :func:`fairseq_oss.consolidation.stream_to_writer`,
for ranks that share a file system. The file is the same, byte for byte: rank 0's
:class:`~fairseq_oss.checkpoint_format.CheckpointWriter` lays out the optimizer records
exactly as the streamed writer would (headers, alignment), leaving their bytes as holes;
each rank puts its shard's bytes at their offsets with ``pwrite`` through its own file
descriptor and fsyncs them; the CRC of each piece goes back to rank 0, which combines
them into the manifest's per-chunk CRCs and the records' headers. Nothing is committed
until every rank reported success.

The sequence, each step on all ranks of ``opt.process_group`` (collective):

1. :func:`all_ranks_see`: rank 0 puts a random token at the start of its temporary file
   and tells the others the file's path; each rank reads the token back through that
   path. Any rank that cannot (no shared file system, another node's file of the same
   name) makes every rank return False: the caller streams the state to rank 0 instead,
   and rank 0 logs who could not see the file. The token is overwritten by the file's
   first header either way.
2. :func:`write_shards`: rank 0 reserves the records, broadcasts their offsets; every
   rank writes and fsyncs its pieces, and reports their CRCs or its error; rank 0 fills
   the records in. An error on any rank raises on every rank (rank 0's caller aborts the
   writer: no file appears under the checkpoint's name).
"""
import logging
import os
import socket
import zlib
from typing import Dict, List, Optional, Tuple

from fairseq_oss import collectives, consolidation
from fairseq_oss.checkpoint_format import CHUNK_BYTES, CheckpointError, StorageRef, _bytes_of, crc32_combine

logger = logging.getLogger(__name__)

_TOKEN_BYTES = 16


def all_ranks_see(opt, writer) -> bool:
    """Whether every rank sees rank 0's temporary file (see the module docstring, 1).
    ``writer`` is rank 0's CheckpointWriter (None elsewhere).

    .. warning:: Collective: call on all ranks.
    """
    offer = None
    if writer is not None:
        try:
            token = os.urandom(_TOKEN_BYTES)
            writer._file.flush()
            os.pwrite(writer._file.fileno(), token, 0)
            os.fsync(writer._file.fileno())
            offer = (os.path.abspath(writer.tmp_path), token)
        except OSError as e:
            logger.warning("oss_adam: cannot prepare a parallel save (%s): rank 0 writes the state alone", e)
    offer = collectives.broadcast_object(offer, opt.process_group, opt.world_size)
    if offer is None:
        return False
    path, token = offer
    seen = "sees it"
    if writer is None:
        try:
            if _read_token(path) != token:
                seen = "sees another file there"
        except OSError as e:
            seen = f"cannot open it ({e.strerror})"
    views = collectives.all_gather_objects((socket.gethostname(), seen), opt.process_group, opt.world_size)
    others = [f"rank {r} on {host} {what}" for r, (host, what) in enumerate(views) if what != "sees it"]
    if others and opt.rank == 0:
        logger.warning(
            "oss_adam: not every rank sees %s (%s): rank 0 gathers and writes the optimizer state alone "
            "(as with --oss-no-shared-fs)", path, "; ".join(others),
        )
    return not others


def _read_token(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, _TOKEN_BYTES, 0)
    finally:
        os.close(fd)


def write_shards(opt, writer) -> Optional[Dict]:
    """Write every rank's shards into rank 0's file (see the module docstring, 2).
    Returns, on rank 0, the :class:`StreamedTensor` placeholders of the stepped
    parameters (as :func:`~fairseq_oss.consolidation.stream_to_writer` does); None
    elsewhere.

    Raises:
        CheckpointError: on every rank, naming the first rank's error, if any rank failed.

    .. warning:: Collective: call on all ranks, after :func:`all_ranks_see` said True.
    """
    segments = opt.partition.segments()
    keys = [key for key, _ in opt.state_shards()]
    layout, error = None, None
    if writer is not None:
        try:
            layout = _reserve(opt, writer, segments, keys)
        except Exception as e:  # noqa: BLE001 - every rank must learn it
            error = f"rank 0: {e}"
    layout = collectives.broadcast_object((layout, os.path.abspath(writer.tmp_path)) if writer else None,
                                          opt.process_group, opt.world_size)
    pieces: Dict[str, List[Tuple[int, int, int]]] = {}
    if layout[0] is not None:
        try:
            pieces = _write_own_pieces(opt, layout[1], layout[0], segments, keys)
        except Exception as e:  # noqa: BLE001
            error = f"rank {opt.rank} on {socket.gethostname()}: {e}"
    reports = collectives.all_gather_objects((error, pieces), opt.process_group, opt.world_size)
    first = next((err for err, _ in reports if err), None)
    if first is None and layout[0] is None:
        first = "rank 0 could not lay out the file"
    if first is not None:
        raise CheckpointError(f"parallel checkpoint write failed: {first}")
    if writer is None:
        return None
    return _fill(opt, writer, layout[0], segments, keys, [p for _, p in reports])


def _reserve(opt, writer, segments, keys) -> List[Tuple[str, int, int]]:
    """Rank 0: reserve one record per segment and key, in the streamed writer's order;
    returns ``(record name, data offset, item size)`` in that order."""
    out = []
    for seg in segments:
        p0 = opt.params[seg.param_offsets[0][0]]
        dtype = opt.state_dtype(p0.dtype)
        itemsize = p0.new_empty(0, dtype=dtype).element_size()
        for _ in keys:
            ref = StorageRef(writer.new_key(), dtype, seg.numel)
            name = f"data/{ref.key}"
            out.append((name, writer.reserve(name, seg.numel * itemsize), itemsize))
    writer._file.flush()
    return out


def _write_own_pieces(opt, path, layout, segments, keys) -> Dict[str, List[Tuple[int, int, int]]]:
    """This rank's shard of every record, written at its offset; returns, per record,
    ``(byte start in the record, length, CRC32)`` of each piece, cut at chunk bounds."""
    shards = dict(opt.state_shards())
    fd = os.open(path, os.O_WRONLY)
    pieces: Dict[str, List[Tuple[int, int, int]]] = {}
    try:
        slot = 0
        for seg in segments:
            for key in keys:
                name, data_offset, itemsize = layout[slot]
                slot += 1
                at = 0  # the bucket's first element within the segment
                for bi in seg.buckets:
                    b = opt.partition.buckets[bi]
                    start, end = b.shard_range(opt.rank)
                    if end > start:
                        data = _bytes_of(shards[key][b.index])
                        pos = (at + start) * itemsize
                        _pwrite_all(fd, data, data_offset + pos)
                        pieces.setdefault(name, []).extend(_crc_pieces(data, pos))
                    at += b.numel
        os.fsync(fd)
    finally:
        os.close(fd)
    return pieces


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _crc_pieces(data: memoryview, pos: int):
    """CRC32s of ``data`` (record bytes from ``pos``), cut where a manifest chunk ends."""
    out, done = [], 0
    while done < len(data):
        take = min(len(data) - done, CHUNK_BYTES - (pos + done) % CHUNK_BYTES)
        out.append((pos + done, take, zlib.crc32(data[done : done + take])))
        done += take
    return out


def _fill(opt, writer, layout, segments, keys, reports) -> Dict:
    """Rank 0: combine every rank's pieces into chunk CRCs, fill the records in, and
    build the manifest's views and the state dict's placeholders."""
    by_record: Dict[str, List[Tuple[int, int, int]]] = {}
    for pieces in reports:
        for name, ps in pieces.items():
            by_record.setdefault(name, []).extend(ps)
    placeholders: Dict[int, Dict] = {}
    views: Dict[str, Dict[str, list]] = {}
    slot = 0
    for seg in segments:
        for key in keys:
            name, _, itemsize = layout[slot]
            slot += 1
            nbytes = seg.numel * itemsize
            crcs, pos = [], 0
            for start, length, crc in sorted(by_record.get(name, [])):
                if start != pos:
                    raise CheckpointError(f"{name}: bytes {pos}-{start} were written by no rank")
                if start % CHUNK_BYTES == 0:
                    crcs.append(crc)
                else:
                    crcs[-1] = crc32_combine(crcs[-1], crc, length)
                pos = start + length
            if pos != nbytes:
                raise CheckpointError(f"{name}: bytes {pos}-{nbytes} were written by no rank")
            writer.fill_reserved(name, crcs)
            ref = StorageRef(name.split("/", 1)[1], opt.state_dtype(opt.params[seg.param_offsets[0][0]].dtype),
                             seg.numel)
            consolidation.record_views(opt, seg, key, ref, views, placeholders)
    writer.extra_manifest["optimizer_views"] = views
    return placeholders

"""Every rank writes its own parts of a save's large records into the one checkpoint file.

Owns the parallel alternative to rank 0 writing them all (:mod:`fairseq_oss.checkpoint.save_records`),
for ranks that share a file system. The file is the same, byte for byte: rank 0's
:class:`~fairseq_oss.checkpoint.format.CheckpointWriter` lays out the records exactly as
it would stream them (headers, alignment), leaving their bytes as holes; each rank puts
its parts (:class:`~fairseq_oss.checkpoint.format.RecordPlan`: its shards of the Adam
state, its 1/N of the weights) at their offsets with ``pwrite`` through its own file
descriptor and fsyncs them; the CRC of each piece goes back to rank 0, which combines
them into the manifest's per-chunk CRCs and the records' headers. Nothing is committed
until every rank reported success.

The sequence, each step on all ranks of ``opt.process_group`` (collective):

1. :func:`all_ranks_see`: rank 0 puts a random token at the start of its temporary file
   and tells the others the file's path; each rank reads the token back through that
   path. Any rank that cannot (no shared file system, another node's file of the same
   name) makes every rank return False: rank 0 then writes everything instead,
   and rank 0 logs who could not see the file. The token is overwritten by the file's
   first header either way.
2. :func:`write_records`: rank 0 reserves the records, broadcasts their offsets; every
   rank writes and fsyncs its parts, and reports their CRCs or its error; rank 0 fills
   the records in. An error on any rank raises on every rank (rank 0's caller aborts the
   writer: no file appears under the checkpoint's name).
"""
import logging
import os
import socket
import zlib
from typing import Dict, List, Optional, Tuple

from fairseq_oss.optim import collectives
from fairseq_oss.checkpoint.format import CHUNK_BYTES, CheckpointError, RecordPlan, crc32_combine

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
            "oss_adam: not every rank sees %s (%s): rank 0 writes the weights and the gathered optimizer "
            "state alone (as with --oss-no-shared-fs)", path, "; ".join(others),
        )
    return not others


def _read_token(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, _TOKEN_BYTES, 0)
    finally:
        os.close(fd)


def write_records(opt, writer, plans: List[RecordPlan]) -> Optional[List[str]]:
    """Write every rank's parts of ``plans`` into rank 0's file (see the module
    docstring, 2). Returns, on rank 0, each plan's record name (``data/KEY``), in order;
    None elsewhere.

    Raises:
        CheckpointError: on every rank, naming the first rank's error, if any rank failed
            (or planned other records than rank 0).

    .. warning:: Collective: call on all ranks, after :func:`all_ranks_see` said True,
       with the same records (``nbytes``) in the same order.
    """
    layout, error = None, None
    if writer is not None:
        try:
            layout = _reserve(writer, plans)
        except Exception as e:  # noqa: BLE001 - every rank must learn it
            error = f"rank 0: {e}"
    layout = collectives.broadcast_object((layout, os.path.abspath(writer.tmp_path)) if writer else None,
                                          opt.process_group, opt.world_size)
    pieces: Dict[str, List[Tuple[int, int, int]]] = {}
    if layout[0] is not None:
        try:
            pieces = _write_own_pieces(layout[1], layout[0], plans)
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
    return _fill(writer, layout[0], [p for _, p in reports])


def _reserve(writer, plans) -> List[Tuple[str, int, int]]:
    """Rank 0: reserve one record per plan, in order; returns ``(record name, data
    offset, size)`` of each."""
    out = []
    for plan in plans:
        name = f"data/{writer.new_key()}"
        out.append((name, writer.reserve(name, plan.nbytes), plan.nbytes))
    writer._file.flush()
    return out


def _write_own_pieces(path, layout, plans) -> Dict[str, List[Tuple[int, int, int]]]:
    """This rank's parts of every record, written at their offsets; returns, per record,
    ``(byte start in the record, length, CRC32)`` of each piece, cut at chunk bounds."""
    if len(layout) != len(plans) or any(n != plan.nbytes for (_, _, n), plan in zip(layout, plans)):
        raise CheckpointError("this rank planned other records than rank 0 (do the ranks hold the same model?)")
    fd = os.open(path, os.O_WRONLY)
    pieces: Dict[str, List[Tuple[int, int, int]]] = {}
    try:
        for (name, data_offset, nbytes), plan in zip(layout, plans):
            for pos, data in plan.pieces():
                if pos + len(data) > nbytes:
                    raise CheckpointError(f"{name}: a part ends at byte {pos + len(data)} of {nbytes}")
                _pwrite_all(fd, data, data_offset + pos)
                pieces.setdefault(name, []).extend(_crc_pieces(data, pos))
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


def _fill(writer, layout, reports) -> List[str]:
    """Rank 0: combine every rank's pieces into chunk CRCs and fill the records in."""
    by_record: Dict[str, List[Tuple[int, int, int]]] = {}
    for pieces in reports:
        for name, ps in pieces.items():
            by_record.setdefault(name, []).extend(ps)
    for name, _, nbytes in layout:
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
    return [name for name, _, _ in layout]

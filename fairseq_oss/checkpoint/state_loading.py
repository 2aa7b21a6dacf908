"""Filling the sharded Adam state from a checkpoint file, at any world size.

Owns :func:`fairseq_oss.checkpoint.load_optimizer_state`: each rank reads only its own slices of the
file, by offset, straight into its shards, checking the CRC of every chunk it reads
(shared file system), or rank 0 reads one bucket at a time and scatters the ranks' slices
(``shared_fs=False``). Errors are agreed on, so that every rank raises the same one.
"""
from typing import Optional

import torch

from fairseq_oss.optim import collectives
from fairseq_oss.checkpoint.format import CheckpointError, CheckpointReader, load_mmap


def load_from_checkpoint(opt, path: str, key: str = "last_optimizer_state", verify: bool = True,
                         shared_fs: bool = True) -> None:
    """Load the state stored under ``key`` of the checkpoint at ``path``, reading only
    this rank's slices, straight into its shards: a rank's memory rises by its own
    shard, never the full state, and no state is broadcast. A fairseq-oss file is read
    by offset (its manifest says where each parameter's state lies) and, with
    ``verify``, the CRC of every chunk read is checked; another ``torch.save`` file is
    mapped (``torch.load(mmap=True)``) and sliced. With ``shared_fs=False`` (ranks do
    not see the same files) rank 0 reads and sends each rank its slices, one bucket at
    a time.

    Raises:
        CheckpointError: on every rank, if any rank found the file unreadable,
            corrupted, or not matching this optimizer; the state is then unusable and
            the caller must not train on (fairseq stops).

    .. warning:: Collective: call on all ranks.
    """
    error, fill, steps, groups = None, None, None, None
    reads = shared_fs or opt.rank == 0
    if reads:
        try:
            fill, steps, groups = _open_state(opt, path, key, verify)
        except CheckpointError as e:
            error = str(e)
    _agree(opt, error)
    if shared_fs:
        try:
            opt.fill_shards(fill, steps)
        except CheckpointError as e:
            error = str(e)
        _agree(opt, error)
    else:
        _scatter_from_rank0(opt, fill, steps)
        groups = collectives.broadcast_object(groups, opt.process_group, opt.world_size)
    opt.apply_groups(groups)


def _open_state(opt, path: str, key: str, verify: bool):
    """Validate the checkpoint's state against this optimizer; return a function that
    fills ``dst`` with elements ``[start, end)`` of parameter ``i``'s state ``k``, the
    steps and the saved param groups."""
    reader = CheckpointReader(path)
    ckpt = load_mmap(path)
    state = ckpt.get(key) if isinstance(ckpt, dict) else None
    if not isinstance(state, dict) or "state" not in state or "param_groups" not in state:
        raise CheckpointError(f"{path}: no optimizer state under '{key}'")
    try:
        steps, saved_ids = opt.validate_state(state, source="the checkpoint")
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    entries = [state["state"].get(sid) for sid in saved_ids]
    views = (reader.manifest or {}).get("optimizer_views")

    def fill(i, k, start, end, dst):
        t = entries[i][k]
        if views is not None and t.dtype == dst.dtype:
            record, offset = views[str(i)][k]
            size = t.element_size()
            staging = dst if dst.device.type == "cpu" else torch.empty(dst.shape, dtype=dst.dtype)
            reader.read_into(record, (offset + start) * size, (offset + end) * size, staging, verify)
            if staging is not dst:
                dst.copy_(staging)
        else:
            dst.copy_(t.reshape(-1)[start:end])

    return fill, steps, state["param_groups"]


def _agree(opt, error: Optional[str]) -> None:
    """Raise on every rank if any rank has an error (collective)."""
    errors = collectives.all_gather_objects(error, opt.process_group, opt.world_size)
    first = next((e for e in errors if e), None)
    if first is not None:
        raise CheckpointError(first)


def _scatter_from_rank0(opt, fill, steps) -> None:
    """Rank 0 reads each bucket of each key from the file and scatters the shards; the
    others receive theirs. One bucket in memory on rank 0."""
    steps = collectives.broadcast_object(steps, opt.process_group, opt.world_size)
    error = None
    buffers = opt.state_bucket_buffers() if opt.rank == 0 else {}
    for b in opt.partition.buckets:
        for key, local in opt.state_shards():
            full = None
            if opt.rank == 0:
                full = buffers[b.kind][: b.numel].zero_()
                for pc in b.pieces:
                    if steps[pc.param] == 0 or error is not None:
                        continue
                    try:
                        fill(pc.param, key, pc.param_offset, pc.param_offset + pc.numel,
                             full[pc.offset : pc.offset + pc.numel])
                    except CheckpointError as e:
                        error = str(e)
            collectives.scatter_shards(full, opt.shard_ranges(b), local[b.index], opt.process_group)
    _agree(opt, error)
    opt.set_steps(steps)

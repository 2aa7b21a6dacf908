"""The few collectives the sharded optimizer uses, each on one flat bucket of tensors.

Owns: world size and rank of a process group, the per-bucket all-gather of the step and
the per-bucket gather of a consolidation. Each function here is collective: every rank of
the group calls it, in the same order, with buckets of the same layout. Nothing here is
pickled: only tensors move. With one process they do no communication.
"""
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist


def world_size_and_rank(group) -> Tuple[int, int]:
    """``(world size, rank)`` in ``group``; ``(1, 0)`` when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def all_gather_ints(value: int, group, device=None) -> List[int]:
    """Every rank's ``value``, in rank order (a one-element tensor each, on ``device``,
    which must be a CUDA device for NCCL; no pickling).

    .. warning:: Collective: call on all ranks.
    """
    world_size, _ = world_size_and_rank(group)
    if world_size == 1:
        return [int(value)]
    out = torch.empty(world_size, dtype=torch.int64, device=device)
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, mine, group=group)
    return out.tolist()


def _global_rank(group, rank: int) -> int:
    if group is None or group is dist.GroupMember.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def all_gather_bucket(bucket: torch.Tensor, shard: torch.Tensor, group, world_size: int):
    """Start filling ``bucket`` (``world_size`` shards end to end) with every rank's
    ``shard``, which is a view of this rank's slot in ``bucket``. Returns the work to pass
    to :func:`wait`, or None when there is nothing to wait for.

    .. warning:: Collective: call on all ranks.
    """
    if world_size == 1:
        return None
    return dist.all_gather_into_tensor(bucket, shard, group=group, async_op=True)


def wait(work) -> None:
    if work is not None:
        work.wait()


def gather_shards(
    local: torch.Tensor, shard_numel: int, recipient: int, group, world_size: int
) -> Optional[torch.Tensor]:
    """Gather every rank's ``local`` shard (at most ``shard_numel`` elements, padded to it)
    on rank ``recipient`` of ``group``. Returns the ``world_size * shard_numel`` elements
    there, shards end to end, and None elsewhere. Peak extra memory: one bucket on the
    recipient, one shard on the others.

    .. warning:: Collective: call on all ranks.
    """
    padded = local
    if world_size == 1:
        return local
    if local.numel() != shard_numel:
        padded = local.new_zeros(shard_numel)
        padded[: local.numel()].copy_(local)
    rank = dist.get_rank(group)
    out = None
    gather_list = None
    if rank == recipient:
        out = local.new_empty(world_size * shard_numel)
        gather_list = list(out.chunk(world_size))
    dist.gather(padded, gather_list, dst=_global_rank(group, recipient), group=group)
    return out


def scatter_shards(full: Optional[torch.Tensor], like: torch.Tensor, shard_numel: int, group, world_size: int):
    """Rank 0 of ``group`` sends shard ``r`` of ``full`` (``world_size`` shards of
    ``shard_numel`` elements end to end) to rank ``r``; returns this rank's shard, with
    the dtype and device of ``like``. ``full`` is read on rank 0 only (None elsewhere).

    .. warning:: Collective: call on all ranks.
    """
    if world_size == 1:
        return full
    out = torch.empty(shard_numel, dtype=like.dtype, device=like.device)
    chunks = list(full.chunk(world_size)) if dist.get_rank(group) == 0 else None
    dist.scatter(out, chunks, src=_global_rank(group, 0), group=group)
    return out


def broadcast_object(obj, group, world_size: int):
    """Rank 0's small picklable ``obj`` on every rank (metadata only, never tensors of state).

    .. warning:: Collective: call on all ranks.
    """
    if world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=_global_rank(group, 0), group=group)
    return box[0]


def all_gather_objects(obj, group, world_size: int) -> list:
    """Every rank's small picklable ``obj`` (an error message, say), in rank order.

    .. warning:: Collective: call on all ranks.
    """
    if world_size == 1:
        return [obj]
    out = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out

"""The few collectives the sharded optimizer uses, each on one flat bucket of tensors.

Owns: world size and rank of a process group, the per-bucket exchange of the step (point
to point, or one all-gather) and the per-bucket gather of a consolidation. Each function
here is collective: every rank of the group calls it, in the same order, with buckets of
the same layout. Nothing here is pickled: only tensors move. With one process they do no
communication.
"""
import contextlib
import logging
import os
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def world_size_and_rank(group) -> Tuple[int, int]:
    """``(world size, rank)`` in ``group``; ``(1, 0)`` when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def backend(group) -> Optional[str]:
    """The backend's name (``"gloo"``, ``"nccl"``, ...), None without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return str(dist.get_backend(group))


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
    _all_gather_single(out, mine, group=group)
    return out.tolist()


# torch 2.13 deprecates all_gather_into_tensor (a FutureWarning on every rank) for
# all_gather_single, the same collective; older torch has only the former.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def global_rank(group, rank: int) -> int:
    """The default group's rank of ``group``'s rank ``rank`` (what point to point takes)."""
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
    return _all_gather_single(bucket, shard, group=group, async_op=True)


def wait(work) -> None:
    if work is not None:
        work.wait()


def wait_all(works: Sequence) -> None:
    for w in works:
        w.wait()


def exchange_pieces(
    mine: Sequence[torch.Tensor], theirs: Dict[int, Sequence[torch.Tensor]], tags: Sequence[int], group
) -> Tuple[Dict[int, list], list]:
    """Start sending this rank's tensors ``mine`` to every rank in ``theirs`` and receiving
    rank ``r``'s tensors into ``theirs[r]``, in place (no staging buffer: the tensors may
    be views into parameters), one message per tensor and peer. Every rank passes the same
    layout: rank ``r``'s ``mine`` matches ``theirs[r]`` on every other rank, tensor for
    tensor, and rank ``r``'s ``j``-th tensor travels with tag ``tags[r] + j`` (tags that
    no other transfer in flight between the same ranks uses). Returns the works: the
    receives by rank, in ``theirs[r]``'s order, and the sends, for :func:`wait_all`.

    .. warning:: Collective: call on all ranks.
    """
    _, rank = world_size_and_rank(group)
    recvs = {
        r: [dist.irecv(t, src=global_rank(group, r), group=group, tag=tags[r] + j) for j, t in enumerate(tensors)]
        for r, tensors in theirs.items()
    }
    sends = [
        dist.isend(t, dst=global_rank(group, r), group=group, tag=tags[rank] + j)
        for r in theirs
        for j, t in enumerate(mine)
    ]
    return recvs, sends


def gather_shards(
    local: torch.Tensor, ranges: Sequence[Tuple[int, int]], recipient: int, group, out: Optional[torch.Tensor]
) -> Optional[torch.Tensor]:
    """Gather every rank's ``local`` shard into ``out`` on rank ``recipient`` of ``group``:
    rank ``r``'s elements land at ``out[ranges[r][0]:ranges[r][1]]``. Returns ``out``
    trimmed to the bucket on the recipient, None elsewhere. Point to point, exact sizes,
    straight into ``out`` (which the caller reuses): no padding, no temporary buffers, so
    the recipient's memory rises by ``out`` alone and the others' not at all.

    .. warning:: Collective: call on all ranks.
    """
    world_size, rank = world_size_and_rank(group)
    numel = ranges[-1][1]
    if rank == recipient:
        start, end = ranges[rank]
        out[start:end].copy_(local)
        works = {
            r: dist.irecv(out[s:e], src=global_rank(group, r), group=group)
            for r, (s, e) in enumerate(ranges)
            if r != rank and e > s
        }
        with _reporting_waits(works, "gathering the optimizer state"):
            for w in works.values():
                w.wait()
        return out[:numel]
    if local.numel():
        dist.send(local, dst=global_rank(group, recipient), group=group)
    return None


# How long a rank waits for others in a consolidation before it logs whom it waits for
# (then again at that interval): a rank that was stopped or is stuck otherwise leaves
# the others silent until the process group's timeout (30 minutes by default).
AWAIT_LOG_SECONDS = float(os.environ.get("FAIRSEQ_OSS_AWAIT_LOG_SECONDS", "60"))


@contextlib.contextmanager
def _reporting_waits(works: Dict[int, object], what: str):
    """While the block runs, log every AWAIT_LOG_SECONDS which ranks' ``works`` are not
    complete yet (a timer thread; it only reads the works' state)."""
    start = time.monotonic()
    state = {"timer": None, "done": False}
    lock = threading.Lock()

    def report():
        with lock:
            if state["done"]:
                return
            waiting = [r for r, w in works.items() if not w.is_completed()]
            if waiting:
                logger.warning(
                    "oss_adam: %s: still waiting for rank(s) %s of the data-parallel group after "
                    "%.0f s (stopped, stuck or very slow?)", what, waiting, time.monotonic() - start,
                )
            arm()

    def arm():
        state["timer"] = threading.Timer(AWAIT_LOG_SECONDS, report)
        state["timer"].daemon = True
        state["timer"].start()

    arm()
    try:
        yield
    finally:
        with lock:
            state["done"] = True
            state["timer"].cancel()


def scatter_shards(
    full: Optional[torch.Tensor], ranges: Sequence[Tuple[int, int]], local: torch.Tensor, group
) -> None:
    """The reverse of :func:`gather_shards` from rank 0: rank ``r`` receives
    ``full[ranges[r][0]:ranges[r][1]]`` into ``local``. ``full`` is read on rank 0 only.

    .. warning:: Collective: call on all ranks.
    """
    world_size, rank = world_size_and_rank(group)
    if rank == 0:
        works = [
            dist.isend(full[s:e].contiguous(), dst=global_rank(group, r), group=group)
            for r, (s, e) in enumerate(ranges)
            if r != 0 and e > s
        ]
        local.copy_(full[ranges[0][0] : ranges[0][1]])
        for w in works:
            w.wait()
    elif local.numel():
        dist.recv(local, src=global_rank(group, 0), group=group)


def broadcast_object(obj, group, world_size: int):
    """Rank 0's small picklable ``obj`` on every rank (metadata only, never tensors of state).

    .. warning:: Collective: call on all ranks.
    """
    if world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=global_rank(group, 0), group=group)
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

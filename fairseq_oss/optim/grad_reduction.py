"""Gradients reduced straight into each rank's shard, bucket by bucket, during backward
(ZeRO stage 2): the reduce-scatter that replaces fairseq's all-reduce for ``oss_adam``.

Owns the gradient side of an update, from the moment autograd accumulates a parameter's
gradient to the moment :class:`~fairseq_oss.optim.sharded_adam.ShardedAdam` is handed each
rank's reduced shard:

1. A hook on every parameter (``register_post_accumulate_grad_hook``) counts, per bucket of
   the optimizer's partition, the parameters whose gradient this backward has produced.
2. The reduction is cut into parts, started in one fixed order on every rank (the
   partition's buckets from last to first, roughly the order backward produces them), each
   as soon as the gradients it covers and every part before it in that order are complete.
   A part's gradients are copied, pre-divided by N as fairseq's DDP does, into its bucket's
   staging buffer. Point to point (gloo, whose own reduce-scatter is several times slower
   than its all-reduce) a part is one rank's slice of a bucket, taken from the bucket's end
   (the gradients backward gives first) to its start, and goes to that rank in one message
   as soon as it is staged, while backward computes the rest of the bucket: one message per
   bucket and peer, the first of them long before the bucket is complete. With
   ``reduce_scatter_tensor`` (NCCL) a part is a whole bucket, one collective.
3. A parameter whose parts have all been staged loses its ``.grad`` at once. During
   backward a rank holds the gradients not staged yet, the staging buffers of at most
   ``in_flight`` buckets (two) and its shards; once the reduction is done, its shard of
   every bucket only (1/N of the gradients, kept from one update to the next). A bucket
   is waited for only when its staging buffer is needed again, by the bucket after next:
   backward goes on while the last two buckets it gave are on their way.
4. :meth:`GradReducer.finish` (fairseq's ``all_reduce_grads`` point) starts what backward
   did not (a parameter without a gradient counts as zeros), waits, sums each rank's
   received slices in rank order (so a run repeats itself bit for bit), and decides which
   parameters have a gradient at all, as fairseq's DDP backends do: ``pytorch_ddp`` leaves
   a parameter that no rank used without one (one small all-reduce of flags), ``legacy_ddp``
   gives every parameter one.

With ``--update-freq``, the backward passes of the first micro-batches run with
``sync_in_backward`` returning False: gradients accumulate locally and are reduced once.

Under fairseq's ``--fp16`` the optimizer's parameter is one flat fp32 master copy of the
model's fp16 parameters, which are what backward gives gradients to: the reducer is then
built over those (``sources``, laid out in the master as ``layout`` says), reduces in their
dtype, as fairseq's DDP does, and hands the optimizer each shard in the master's dtype
(keeping that copy only).
"""
import collections
import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from fairseq_oss.optim import collectives
from fairseq_oss.optim.partition import Piece, bucket_onto, clip_pieces

logger = logging.getLogger(__name__)

# Point-to-point tags of the reduction (the step's exchange uses small tags of its own).
TAG_BASE = 1 << 20
UNUSED_POLICIES = ("skip", "zero")


@dataclass(frozen=True)
class _Part:
    """One part of a reduction: elements ``[lo, hi)`` of a bucket's padded staging buffer
    (``pieces``, offsets in the bucket), sent to rank ``dest`` (point to point) or to all
    (``None``: one reduce-scatter of the whole bucket). ``first``: the bucket's first part
    in the reduction's order."""

    bucket: int
    dest: Optional[int]
    lo: int
    hi: int
    pieces: Tuple[Piece, ...]
    first: bool


class GradReducer:
    """The reduce-scatter of one :class:`ShardedAdam`'s gradients; see the module docstring.

    Arguments:
        optimizer: the ShardedAdam whose partition, parameters and process group are used.
        method: ``"p2p"`` or ``"reduce_scatter"``; ``None``: p2p on gloo, else reduce_scatter.
        unused: ``"skip"`` (pytorch_ddp: a parameter no rank used keeps no gradient and is
            not stepped) or ``"zero"`` (legacy_ddp: every parameter gets a gradient).
        divide: ``"mul"`` (multiply by 1/N, as PyTorch's DDP) or ``"div"`` (divide by N, as
            fairseq's legacy DDP); both pre-scale each rank's gradients before the sum.
        sync_in_backward: called as each gradient arrives; False (inside ``no_sync``)
            leaves the gradients to accumulate and to :meth:`finish`.
        in_flight: buckets in flight at once while backward goes on, and staging buffers
            (each of one bucket, plus room for the others' slices of its shard with p2p):
            starting a bucket waits for the oldest in flight when ``in_flight`` are.
        sources, layout: the tensors whose gradients are reduced, when they are not the
            optimizer's parameters: ``layout[i]`` lists the ``(source index, numel)`` laid
            end to end in optimizer parameter ``i`` (:func:`~fairseq_oss.optim.partition.onto`).
            The reduction runs in the sources' dtype; an optimizer parameter has a gradient
            when any of its sources has one.

    .. warning:: Backward passes that reduce, and :meth:`finish`, are collective: run them
        on all ranks, for the same buckets.
    """

    def __init__(
        self,
        optimizer,
        *,
        method: Optional[str] = None,
        unused: str = "skip",
        divide: str = "mul",
        sync_in_backward: Callable[[], bool] = lambda: True,
        in_flight: int = 2,
        sources: Optional[List[torch.Tensor]] = None,
        layout: Optional[List[List[Tuple[int, int]]]] = None,
    ):
        if method is None:
            method = "p2p" if collectives.backend(optimizer.process_group) == "gloo" else "reduce_scatter"
        if method not in ("p2p", "reduce_scatter"):
            raise ValueError(f"method must be 'p2p' or 'reduce_scatter', got {method!r}")
        if unused not in UNUSED_POLICIES:
            raise ValueError(f"unused must be one of {UNUSED_POLICIES}, got {unused!r}")
        if divide not in ("mul", "div"):
            raise ValueError(f"divide must be 'mul' or 'div', got {divide!r}")
        self.opt = optimizer
        self.method, self.unused, self.divide = method, unused, divide
        self.sync_in_backward = sync_in_backward
        self.in_flight = max(1, in_flight)
        self.world_size, self.rank, self.group = optimizer.world_size, optimizer.rank, optimizer.process_group
        if (sources is None) != (layout is None):
            raise ValueError("sources and layout go together")
        part = optimizer.partition
        self._layout = layout
        self._buckets = part.buckets if layout is None else [bucket_onto(b, layout) for b in part.buckets]
        self._params: List[torch.Tensor] = optimizer.params if sources is None else list(sources)
        # What the optimizer takes each bucket's shard in (its parameters' dtype).
        self._out_dtypes = [optimizer.params[b.pieces[0].param].dtype for b in part.buckets]
        # A parameter that requires no gradient never gets one: no hook, not waited for.
        grads = [p.requires_grad for p in self._params]
        self._parts = self._cut_into_parts()
        self._part_params = [sorted({pc.param for pc in part.pieces if grads[pc.param]}) for part in self._parts]
        self._param_parts: Dict[int, List[int]] = collections.defaultdict(list)
        for u, params in enumerate(self._part_params):
            for i in params:
                self._param_parts[i].append(u)
        # Each bucket's reduced shard, padded to the bucket's shard size (reduce_scatter's output).
        self._shards: List[Optional[torch.Tensor]] = [None] * len(self._buckets)
        # Those shards in the optimizer's dtype, where the reduction's differs (the reduced
        # ones are then let go once converted: a rank keeps one copy of its shards).
        self._out: List[Optional[torch.Tensor]] = [None] * len(self._buckets)
        self._staging: Dict[str, List[torch.Tensor]] = {}
        self._slots: Dict[str, int] = {}
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._hook_for(i))
            for i, p in enumerate(self._params)
            if p.requires_grad
        ]
        self._reset()

    # ------------------------------------------------------------------ per update

    def _cut_into_parts(self) -> List["_Part"]:
        """The parts of the reduction in the order they start (see the module docstring)."""
        parts = []
        for b in range(len(self._buckets) - 1, -1, -1):
            bucket = self._buckets[b]
            c = bucket.shard_numel
            if self.method == "reduce_scatter":
                ranges = [(None, 0, c * self.world_size)]
            else:
                ranges = [(r, r * c, (r + 1) * c) for r in range(self.world_size - 1, -1, -1)]
            for dest, lo, hi in ranges:
                pieces = tuple(
                    Piece(pc.param, pc.param_offset, pc.offset + lo, pc.numel)
                    for pc in clip_pieces(bucket.pieces, lo, min(hi, bucket.numel))
                )
                parts.append(_Part(b, dest, lo, hi, pieces, first=dest in (None, self.world_size - 1)))
        return parts

    def _reset(self) -> None:
        self._remaining = [len(ps) for ps in self._part_params]
        self._staged = [0] * len(self._params)
        self._used = [False] * len(self._params)
        self._next = 0  # index in self._parts of the next part to start
        self._flying: collections.deque = collections.deque()
        self._done = False

    def _hook_for(self, index: int):
        def hook(param):
            if self._done or not self.sync_in_backward():
                return
            for u in self._param_parts[index]:
                self._remaining[u] -= 1
            self._start_ready()

        return hook

    def _start_ready(self) -> None:
        while self._next < len(self._parts) and self._remaining[self._next] == 0:
            self._start(self._next)
            self._next += 1

    def finish(self) -> None:
        """Reduce what backward has not, wait for every bucket, and hand the optimizer the
        reduced shards (``ShardedAdam.set_reduced_grads``). Does nothing if this update is
        already reduced.

        .. warning:: Collective: call on all ranks.
        """
        if self._done:
            return
        while self._next < len(self._parts):
            self._start(self._next)
            self._next += 1
        used = self._used_anywhere()  # on its way while the last buckets arrive
        while self._flying:
            self._complete(self._flying.popleft())
        self._staging.clear()  # between reductions a rank keeps its shards only
        used = used()
        if self._layout is not None:
            used = [any(used[t] for t, _ in runs) for runs in self._layout]
        for p in self._params:
            p.grad = None
        views = []
        for b, bucket in enumerate(self._buckets):
            start, end = bucket.shard_range(self.rank)
            shard = self._shards[b]
            if shard.dtype != self._out_dtypes[b]:
                if self._out[b] is None:
                    self._out[b] = torch.empty_like(shard, dtype=self._out_dtypes[b])
                shard = self._out[b].copy_(shard)
                self._shards[b] = None  # the reduction's own dtype is not kept between updates
            views.append(shard[: end - start])
        self.opt.set_reduced_grads(views, used)
        self._done = True

    def reset(self) -> None:
        """Forget this update's reduction (fairseq's ``zero_grad``): the next backward
        starts a new one.

        Raises:
            RuntimeError: if backward has begun this update's reduction and :meth:`finish`
                has not run (fairseq's recovery from running out of memory in the middle of
                backward): the other ranks wait for the rest of it, and what this rank has
                already sent cannot be taken back. Failing here ends the run at once with
                the reason, where going on would leave every rank waiting.
        """
        if self._next and not self._done:
            # logged too: the launcher may report another rank's failure (a lost peer) first
            message = (
                f"oss_adam: this rank's backward pass stopped after it had begun reducing the update's "
                f"gradients with the other ranks ({self._next} of {len(self._parts)} parts sent or "
                f"received), and the ranks can no longer agree on this update. fairseq's recovery from "
                f"running out of memory in the middle of backward is not supported with "
                f"--oss-grad-reduction reduce_scatter: lower --max-tokens or --batch-size, or use "
                f"--oss-grad-reduction all_reduce --ddp-backend legacy_ddp, where fairseq recovers"
            )
            logger.error(message)
            raise RuntimeError(message)
        self._staging.clear()
        self._reset()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ one bucket

    def _staging_buffers(self, bucket) -> List[Tuple[Tuple[torch.Tensor, ...], torch.Tensor]]:
        """``in_flight`` reusable (staging, received) pairs for the bucket's kind (fewer
        when it has fewer buckets), made for one reduction and let go by :meth:`finish`.
        The staging is one tensor of the whole padded bucket for ``reduce_scatter_tensor``,
        and one tensor per rank's slice point to point, where nothing needs it whole: then
        no buffer of the reduction reaches glibc's mmap threshold (32 MiB, the default
        bucket's size) from 2 ranks on, and on CPU its memory is reused from one update to
        the next instead of mapped afresh (:mod:`fairseq_oss.integration.malloc`)."""
        bufs = self._staging.get(bucket.kind)
        if bufs is None:
            same = [b for b in self._buckets if b.kind == bucket.kind]
            c = max(b.shard_numel for b in same)
            p0 = self._params[bucket.pieces[0].param]
            if self.method == "p2p":
                sizes, recv = [c] * self.world_size, (self.world_size - 1) * c
            else:
                sizes, recv = [c * self.world_size], 0
            bufs = [
                (tuple(p0.new_empty(n) for n in sizes), p0.new_empty(recv))
                for _ in range(min(self.in_flight, len(same)))
            ]
            self._staging[bucket.kind] = bufs
            self._slots[bucket.kind] = 0
        return bufs

    def _start(self, u: int) -> None:
        part = self._parts[u]
        b = part.bucket
        bucket = self._buckets[b]
        c = bucket.shard_numel
        if part.first:  # the bucket's first part: a staging buffer, and an entry in flight
            while len(self._flying) >= self.in_flight:
                self._complete(self._flying.popleft())
            bufs = self._staging_buffers(bucket)
            # Round robin over in_flight buffers, buckets completed first in, first out:
            # the buckets of this kind still in flight (at most in_flight - 1, the latest)
            # hold the buffers used last, and the one reused here was completed.
            slot = self._slots[bucket.kind] = (self._slots[bucket.kind] + 1) % len(bufs)
            staging, recv = bufs[slot]
            if self._shards[b] is None:
                self._shards[b] = recv.new_empty(c)
            # this bucket's padded c * N elements: its slices, or one tensor of them all
            staging = tuple(t[:c] for t in staging) if len(staging) > 1 else (staging[0][: c * self.world_size],)
            self._flying.append(
                {"bucket": b, "staging": staging, "region": self._region_of(staging, c), "recv": recv, "works": []}
            )
        flying = self._flying[-1]
        recv, shard = flying["recv"], self._shards[b]
        region = flying["region"]
        for pc in part.pieces:
            dst = region(pc.offset, pc.offset + pc.numel)
            g = self._params[pc.param].grad
            if g is None:
                dst.zero_()
                continue
            self._used[pc.param] = True
            src = g.reshape(-1)[pc.param_offset : pc.param_offset + pc.numel]
            if self.divide == "mul":
                torch.mul(src, 1.0 / self.world_size, out=dst)
            else:
                torch.div(src, self.world_size, out=dst)
        if bucket.numel < part.hi:
            region(max(part.lo, bucket.numel), part.hi).zero_()  # the padding
        # Every piece of these parameters is in a staging buffer now: autograd's copy goes.
        for i in self._part_params[u]:
            self._staged[i] += 1
            if self._staged[i] == len(self._param_parts[i]):
                self._params[i].grad = None
        works = flying["works"]
        if part.dest is None:
            works.append(dist.reduce_scatter_tensor(shard, flying["staging"][0], group=self.group, async_op=True))
        elif part.dest != self.rank:
            peer = collectives.global_rank(self.group, part.dest)
            works.append(dist.isend(region(part.lo, part.hi), dst=peer, group=self.group, tag=TAG_BASE + b))
        else:  # this rank's own slice: the others' slices of it are received
            for r in range(self.world_size):
                if r != self.rank:
                    peer = collectives.global_rank(self.group, r)
                    works.append(dist.irecv(self._from(recv, r, c), src=peer, group=self.group, tag=TAG_BASE + b))

    @staticmethod
    def _region_of(staging: Tuple[torch.Tensor, ...], c: int) -> Callable[[int, int], torch.Tensor]:
        """``region(lo, hi)``: the staging of elements ``[lo, hi)`` of a bucket's padded
        layout, in one tensor, or in rank ``lo // c``'s slice (a range within one slice:
        a point-to-point part is one rank's slice, and its pieces are clipped to it)."""
        if len(staging) == 1:
            return lambda lo, hi: staging[0][lo:hi]

        def region(lo: int, hi: int) -> torch.Tensor:
            k = lo // c
            return staging[k][lo - k * c : hi - k * c]

        return region

    def _from(self, recv: torch.Tensor, r: int, c: int) -> torch.Tensor:
        """Where rank ``r``'s slice of this rank's shard (``c`` elements) is received:
        the other ranks' slices, in rank order."""
        k = r if r < self.rank else r - 1
        return recv[k * c : (k + 1) * c]

    def _complete(self, flying) -> None:
        collectives.wait_all(flying["works"])
        if self.method != "p2p":
            return
        # Rank order, own slice in its place: the same sum on every rank, run after run.
        b = flying["bucket"]
        c = self._buckets[b].shard_numel
        recv, shard, own = flying["recv"], self._shards[b], flying["region"]
        parts = [
            own(r * c, (r + 1) * c) if r == self.rank else self._from(recv, r, c) for r in range(self.world_size)
        ]
        if len(parts) == 1:  # one rank: its own slice is the sum
            shard.copy_(parts[0])
            return
        torch.add(parts[0], parts[1], out=shard)
        for t in parts[2:]:
            shard.add_(t)

    def _used_anywhere(self) -> Callable[[], List[bool]]:
        """Start finding out which parameters have a gradient on some rank (every part
        started: this rank's ``_used`` is final); the result, once called. Collective
        (an all-reduce of one flag per parameter) with ``unused="skip"``: started at the
        same point of :meth:`finish` on every rank, after every part."""
        if self.unused == "zero":  # as legacy DDP: every parameter that requires one
            return lambda: [p.requires_grad for p in self._params]
        device = self._params[0].device if self._params else None
        flags = torch.tensor([int(u) for u in self._used], dtype=torch.int32, device=device)
        work = dist.all_reduce(flags, group=self.group, async_op=True)

        def result() -> List[bool]:
            collectives.wait(work)
            return [bool(v) for v in flags.tolist()]

        return result

    # ------------------------------------------------------------------ accounting

    def held_bytes(self) -> Dict[str, int]:
        """Gradient bytes this rank holds now: its reduced shards, its staging buffers and
        the ``.grad`` tensors autograd still holds."""
        shard = sum(s.numel() * s.element_size() for s in self._shards + self._out if s is not None)
        staging = sum(
            t.numel() * t.element_size()
            for bufs in self._staging.values()
            for slices, recv in bufs
            for t in (*slices, recv)
        )
        grads = sum(p.grad.numel() * p.grad.element_size() for p in self._params if p.grad is not None)
        return {"shards": shard, "staging": staging, "grads": grads}


# Elements whose 2-norm total_norm takes in one float32 reduction: few enough that each is
# right to float32's rounding (one float32 norm of a few million elements is off by about
# 5e-5 on CPU). A float64 norm would be closer still, but it makes a float64 copy of the
# shard: 3.5x to 20x the time on CPU (scripts/bench_norm.py).
NORM_CHUNK = 4096


def squared_norm(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t``'s squares, in float64: float32 norms of its runs of
    :data:`NORM_CHUNK` elements, squared and summed in float64 (inf or nan as ``t`` holds)."""
    flat = t.reshape(-1)
    whole = flat.numel() // NORM_CHUNK * NORM_CHUNK
    rest = torch.linalg.vector_norm(flat[whole:], 2, dtype=torch.float32)
    runs = torch.linalg.vector_norm(flat[:whole].view(-1, NORM_CHUNK), 2, dim=1, dtype=torch.float32)
    return rest.double().square() + runs.double().square().sum()


def total_norm(shards: List[torch.Tensor], group, params: List[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of the whole summed gradient, from every rank's ``shards``: the squares
    summed in float64 here (:func:`squared_norm`), then one all-reduce of that scalar;
    float32, as fairseq's ``clip_grad_norm_`` returns it, on the parameters' device.

    .. warning:: Collective: call on all ranks.
    """
    device = params[0].device if params else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for s in shards:
        if s.numel():
            sq += squared_norm(s)
    world_size, _ = collectives.world_size_and_rank(group)
    if world_size > 1:
        dist.all_reduce(sq, group=group)
    return sq.sqrt().float()

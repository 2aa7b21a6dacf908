"""The step's hand-over of each rank's updated shard to the other ranks, and what of it is
still on its way.

Owns the exchange that makes the parameters whole again on every rank after
:meth:`~fairseq_oss.optim.sharded_adam.ShardedAdam.step` (each rank updates only its shard
of each bucket): point to point between the parameters themselves on gloo (one message per
piece and peer, no copies), or one ``all_gather_into_tensor`` per bucket through one of two
gather buffers (NCCL). The step starts each bucket's exchange as soon as its shard is
updated; it then either waits for all of them, or (``defer``) returns with them in flight,
and whoever reads a parameter first waits for what of it has not arrived yet:

* :meth:`ParamExchange.wait` for one parameter: on gloo, the messages carrying its pieces
  only, so a forward pass waits layer by layer while the later layers are still arriving;
  with the all-gather, the buckets holding it;
* :meth:`ParamExchange.wait_all` for everything, sends included (the next step writes into
  the memory they send from).

:mod:`fairseq_oss.optim.param_reads` decides where those waits happen. Messages carry tags
of their own (``EXCHANGE_TAG_BASE`` and up), so an exchange in flight never takes the
messages of any other point-to-point transfer of the same ranks.
"""
import logging
import threading
import weakref
from typing import Dict, List, Sequence, Set, Tuple

import torch

from fairseq_oss import exit_handlers
from fairseq_oss.optim import collectives
from fairseq_oss.optim.partition import Bucket, Piece

logger = logging.getLogger(__name__)

# Tags of the exchange's messages: one per piece of every rank's shard of every bucket,
# above the gradient reduction's (grad_reduction.TAG_BASE + bucket, below 1 << 21).
EXCHANGE_TAG_BASE = 1 << 24


class _PointToPoint:
    """One bucket's messages: the receives by parameter, and the sends."""

    def __init__(self, recvs: Dict[int, list], sends: list):
        self.recvs, self.sends = recvs, sends

    def wait(self, param: int) -> None:
        collectives.wait_all(self.recvs.pop(param, ()))

    def wait_all(self) -> None:
        for works in self.recvs.values():
            collectives.wait_all(works)
        self.recvs = {}
        collectives.wait_all(self.sends)
        self.sends = []


class _AllGather:
    """One bucket's all-gather through a gather buffer, copied out once it is done."""

    def __init__(self, work, copy_out):
        self.work, self.copy_out = work, copy_out

    def wait(self, param: int) -> None:
        self.wait_all()

    def wait_all(self) -> None:
        if self.copy_out is not None:
            collectives.wait(self.work)
            copy_out, self.copy_out = self.copy_out, None
            # Writes into the parameters: a TorchFunctionMode that waits for the
            # parameters it sees (param_reads) must not see these.
            with torch._C.DisableTorchFunction():
                copy_out()


class ParamExchange:
    """The exchanges of one :class:`ShardedAdam`'s steps; see the module docstring.

    Arguments:
        params: the optimizer's parameters, in optimizer order.
        buckets: the partition's buckets.
        shards: ``shards[b][r]``: the pieces of rank ``r``'s shard of bucket ``b``.
        method: ``"p2p"`` or ``"all_gather"``.

    .. warning:: :meth:`start` is collective: call it on all ranks, for the same buckets in
        the same order. The waits are not: each rank waits for its own messages. The waits
        may come from any thread (a copy or a pickle of a parameter waits on the thread
        that makes it): one at a time, and a wait returns only once what it waited for
        has arrived, whichever thread received it.
    """

    def __init__(self, params: Sequence[torch.Tensor], buckets: Sequence[Bucket],
                 shards: Sequence[Sequence[Tuple[Piece, ...]]], method: str, group):
        self.params, self.buckets, self.shards = list(params), list(buckets), shards
        self.method, self.group = method, group
        self.world_size, self.rank = collectives.world_size_and_rank(group)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        # Each parameter's buckets (a big one spans several), and the first tag of each
        # rank's pieces in each bucket: the same numbers on every rank.
        self._buckets_of: Dict[int, List[int]] = {}
        self._first_tag: List[List[int]] = []
        tag = EXCHANGE_TAG_BASE
        for b in self.buckets:
            for pc in b.pieces:
                held = self._buckets_of.setdefault(pc.param, [])
                if not held or held[-1] != b.index:
                    held.append(b.index)
            self._first_tag.append([])
            for r in range(self.world_size):
                self._first_tag[-1].append(tag)
                tag += len(shards[b.index][r])
        self._in_flight: Dict[int, object] = {}  # bucket index -> _PointToPoint or _AllGather
        self.unread: Set[int] = set()  # parameters with pieces not received yet
        self._buffers: Dict[str, List[torch.Tensor]] = {}
        self._buffer_user: Dict[Tuple[str, int], int] = {}  # (kind, slot) -> bucket in flight
        # Held while the bookkeeping above changes and while a wait blocks: a second
        # thread asking for a parameter that a first one is receiving waits until it has.
        self._lock = threading.RLock()
        _LIVE.add(self)

    @property
    def in_flight(self) -> bool:
        """Some exchange is not waited for yet (sends included)."""
        return bool(self._in_flight)

    def index_of(self, tensor: torch.Tensor):
        """The parameter index of ``tensor`` (a parameter, or a view of one), or None."""
        i = self._index.get(id(tensor))
        if i is None and tensor._base is not None:
            i = self._index.get(id(tensor._base))
        return i

    def _view(self, pc: Piece) -> torch.Tensor:
        return self.params[pc.param].data.view(-1)[pc.param_offset : pc.param_offset + pc.numel]

    # ------------------------------------------------------------------ starting

    def start(self, bucket: Bucket) -> None:
        """Start handing this rank's (updated) shard of ``bucket`` to every other rank and
        receiving theirs into the parameters. Collective."""
        if self.world_size == 1:
            return
        with self._lock:
            if self.method == "p2p":
                exchange = self._start_p2p(bucket)
            else:
                exchange = self._start_all_gather(bucket)
            self._in_flight[bucket.index] = exchange

    def _start_p2p(self, bucket: Bucket) -> _PointToPoint:
        shards = self.shards[bucket.index]
        mine = [self._view(pc) for pc in shards[self.rank]]
        theirs = {r: [self._view(pc) for pc in shards[r]] for r in range(self.world_size) if r != self.rank}
        recvs, sends = collectives.exchange_pieces(mine, theirs, self._first_tag[bucket.index], self.group)
        by_param: Dict[int, list] = {}
        for r, works in recvs.items():
            for pc, work in zip(shards[r], works):
                by_param.setdefault(pc.param, []).append(work)
        self.unread.update(by_param)
        return _PointToPoint(by_param, sends)

    def _start_all_gather(self, bucket: Bucket) -> _AllGather:
        slot = (bucket.kind, bucket.index % 2)
        previous = self._buffer_user.get(slot)
        if previous is not None and previous in self._in_flight:
            self._finish(previous)  # its buffer is about to be refilled
        self._buffer_user[slot] = bucket.index
        buf = self._buffer(bucket, slot[1])
        c = bucket.shard_numel
        shard = buf[self.rank * c : (self.rank + 1) * c]
        for pc in self.shards[bucket.index][self.rank]:
            shard[pc.offset : pc.offset + pc.numel].copy_(self._view(pc))
        work = collectives.all_gather_bucket(buf, shard, self.group, self.world_size)

        def copy_out():
            for r in range(self.world_size):
                if r == self.rank:  # already in place
                    continue
                for pc in self.shards[bucket.index][r]:
                    self._view(pc).copy_(buf[r * c + pc.offset : r * c + pc.offset + pc.numel])

        self.unread.update(pc.param for pc in bucket.pieces)
        return _AllGather(work, copy_out)

    def _buffer(self, bucket: Bucket, slot: int) -> torch.Tensor:
        """One of two reusable gather buffers for the bucket's dtype and device."""
        buffers = self._buffers.get(bucket.kind)
        if buffers is None:
            size = max(b.shard_numel for b in self.buckets if b.kind == bucket.kind)
            p0 = self.params[bucket.pieces[0].param]
            # Two, so that one bucket is filled while the previous one is still in flight.
            buffers = [torch.empty(size * self.world_size, dtype=p0.dtype, device=p0.device) for _ in range(2)]
            self._buffers[bucket.kind] = buffers
        return buffers[slot][: bucket.shard_numel * self.world_size]

    # ------------------------------------------------------------------ waiting

    def wait(self, param: int) -> None:
        """Wait until parameter ``param`` (an index) is whole on this rank."""
        if param not in self.unread:
            return
        with self._lock:
            if param not in self.unread:  # another thread received it meanwhile
                return
            for b in self._buckets_of.get(param, ()):
                exchange = self._in_flight.get(b)
                if exchange is not None:
                    exchange.wait(param)
                    if isinstance(exchange, _AllGather):
                        self._finish(b)
            self.unread.discard(param)

    def wait_tensor(self, tensor: torch.Tensor) -> None:
        """:meth:`wait` for ``tensor`` if it is one of the parameters or a view of one."""
        i = self.index_of(tensor)
        if i is not None:
            self.wait(i)

    def _finish(self, bucket: int) -> None:
        exchange = self._in_flight.pop(bucket, None)
        if exchange is None:  # finished meanwhile
            return
        exchange.wait_all()
        self.unread.difference_update(
            pc.param for pc in self.buckets[bucket].pieces
            if not any(b in self._in_flight for b in self._buckets_of[pc.param])
        )

    def wait_all(self) -> None:
        """Wait for every exchange in flight, sends included."""
        with self._lock:
            for b in sorted(self._in_flight):
                self._finish(b)
            self.unread.clear()


_LIVE: "weakref.WeakSet[ParamExchange]" = weakref.WeakSet()


def wait_for(tensor: torch.Tensor) -> None:
    """Wait until ``tensor``, if it is a parameter (or a view of one) of any exchange in
    this process, holds what that exchange's last step computed. Not collective."""
    for exchange in list(_LIVE):
        if exchange.unread:
            exchange.wait_tensor(tensor)


@exit_handlers.register
def _wait_at_exit() -> None:
    """A process that leaves with an exchange in flight (training ended right after a step,
    nothing read the parameters since) waits for it first, so that no peer loses the
    connection in the middle of a message it is still receiving."""
    for exchange in list(_LIVE):
        if exchange.in_flight:
            try:
                exchange.wait_all()
            except Exception as e:  # a peer that is gone: nothing left to protect
                logger.warning("oss_adam: the last step's exchange did not complete at exit: %s", e)

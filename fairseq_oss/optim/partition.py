"""Which rank owns which elements of the optimizer state.

This module owns the layout, and nothing else: it imports no ``torch.distributed`` and
holds no tensors, so every rule here is tested in one process.

The layout, from the parameters in optimizer order:

1. Consecutive parameters of one param group with one dtype and device form a *segment*,
   laid end to end in a virtual flat space.
2. Each segment is cut into *buckets* of ``bucket_numel`` elements (the last one shorter).
   Buckets cut through parameters where they must: one big embedding spans many buckets.
   Bucket boundaries do not depend on the world size.
3. Each bucket is cut into ``world_size`` equal *shards* of ``ceil(numel / world_size)``
   elements (the last ones shorter or empty); rank ``r`` owns shard ``r`` of every bucket.

So ranks differ by less than one element per bucket (element-granular balance, which
whole-parameter assignment cannot give), and one ``all_gather_into_tensor`` per bucket,
with every rank sending its shard, rebuilds the bucket on all ranks.
"""
import bisect
import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple


@dataclass(frozen=True)
class ParamSpec:
    """What the layout needs to know of one parameter."""

    group: int  # index of its param group
    numel: int
    kind: str  # dtype and device, e.g. "torch.float32@cpu": buckets never mix kinds


@dataclass(frozen=True)
class Piece:
    """A contiguous run of one parameter's elements inside a bucket or a shard."""

    param: int  # global parameter index: the key of its entry in the state dict
    param_offset: int  # first element, in the parameter's flattened view
    offset: int  # first element, in the bucket (or shard) that holds the piece
    numel: int


@dataclass(frozen=True)
class Bucket:
    index: int
    group: int
    kind: str
    numel: int
    world_size: int
    pieces: Tuple[Piece, ...]

    @property
    def shard_numel(self) -> int:
        """Elements each rank sends in the bucket's all-gather (the padded shard size)."""
        return -(-self.numel // self.world_size)

    def shard_range(self, rank: int) -> Tuple[int, int]:
        """``[start, end)`` of rank's shard within the bucket; empty for ranks past the end."""
        c = self.shard_numel
        return min(rank * c, self.numel), min((rank + 1) * c, self.numel)

    def shard_pieces(self, rank: int) -> Tuple[Piece, ...]:
        """The pieces of rank's shard, with offsets relative to the shard's start."""
        start, end = self.shard_range(rank)
        return clip_pieces(self.pieces, start, end)


def clip_pieces(pieces: Sequence[Piece], start: int, end: int) -> Tuple[Piece, ...]:
    """The parts of ``pieces`` (offsets in one space) inside ``[start, end)``,
    re-based so that ``start`` becomes offset 0."""
    out = []
    for pc in pieces:
        lo, hi = max(pc.offset, start), min(pc.offset + pc.numel, end)
        if lo < hi:
            out.append(Piece(pc.param, pc.param_offset + lo - pc.offset, lo - start, hi - lo))
    return tuple(out)


def onto(pieces: Sequence[Piece], layout: Sequence[Sequence[Tuple[int, int]]]) -> Tuple[Piece, ...]:
    """``pieces`` of flat parameters, re-expressed as pieces of the tensors laid end to end
    in them (fairseq's ``--fp16`` master copy: one fp32 parameter that holds every model
    parameter in turn). ``layout[i]``: the ``(tensor index, numel)`` of the tensors that
    parameter ``i`` holds, in order. Offsets in the bucket (or shard) are kept, so a
    re-expressed bucket still matches its shards element for element."""
    starts = []
    for runs in layout:
        acc, s = 0, []
        for _, numel in runs:
            s.append(acc)
            acc += numel
        starts.append(s)
    out = []
    for pc in pieces:
        runs, s = layout[pc.param], starts[pc.param]
        k = max(0, bisect.bisect_right(s, pc.param_offset) - 1)
        end = pc.param_offset + pc.numel
        while k < len(runs) and s[k] < end:
            target, numel = runs[k]
            lo, hi = max(s[k], pc.param_offset), min(s[k] + numel, end)
            if lo < hi:
                out.append(Piece(target, lo - s[k], pc.offset + lo - pc.param_offset, hi - lo))
            k += 1
    return tuple(out)


def bucket_onto(bucket: Bucket, layout: Sequence[Sequence[Tuple[int, int]]]) -> Bucket:
    """``bucket`` with its pieces :func:`onto` the tensors of ``layout``."""
    return dataclasses.replace(bucket, pieces=onto(bucket.pieces, layout))


@dataclass(frozen=True)
class Segment:
    """A run of buckets of one param group and kind: one contiguous flat space, which is
    also how a checkpoint stores its Adam state (one storage per segment and state key,
    each parameter's state a view at ``param_offsets``), whatever the world size."""

    buckets: Tuple[int, ...]
    numel: int
    param_offsets: Tuple[Tuple[int, int], ...]  # (param, first element in the segment)


@dataclass(frozen=True)
class Partition:
    world_size: int
    buckets: Tuple[Bucket, ...]
    param_numels: Tuple[int, ...]

    def shard_numel(self, rank: int) -> int:
        """Optimizer-state elements (per state tensor) that rank holds."""
        return sum(e - s for s, e in (b.shard_range(rank) for b in self.buckets))

    def segments(self) -> Tuple[Segment, ...]:
        out, run = [], []

        def close():
            if run:
                start, offsets = 0, []
                for bi in run:
                    b = self.buckets[bi]
                    offsets += [(pc.param, start + pc.offset) for pc in b.pieces if pc.param_offset == 0]
                    start += b.numel
                out.append(Segment(tuple(run), start, tuple(offsets)))

        for b in self.buckets:
            if run and (self.buckets[run[-1]].group, self.buckets[run[-1]].kind) != (b.group, b.kind):
                close()
                run = []
            run.append(b.index)
        close()
        return tuple(out)

    def param_shards(self, rank: int) -> Dict[int, List[Tuple[int, Piece]]]:
        """For each parameter, the ``(bucket index, piece)`` pairs of rank's shards that
        hold part of it; piece offsets are relative to the shard."""
        out: Dict[int, List[Tuple[int, Piece]]] = {}
        for b in self.buckets:
            for pc in b.shard_pieces(rank):
                out.setdefault(pc.param, []).append((b.index, pc))
        return out


def _full_bucket_numel(world_size: int, bucket_numel: int) -> int:
    """Full buckets split evenly into shards: the bucket rounded down to a multiple of N."""
    return max(world_size, bucket_numel // world_size * world_size)


def bucket_count(params: Sequence[ParamSpec], world_size: int, bucket_numel: int) -> int:
    """How many buckets :func:`partition` makes of ``params``, without making them."""
    full = _full_bucket_numel(world_size, max(1, bucket_numel))
    count, key, filled = 0, None, 0
    for spec in params:
        if (spec.group, spec.kind) != key:
            count += -(-filled // full)
            key, filled = (spec.group, spec.kind), 0
        filled += spec.numel
    return count + -(-filled // full)


def partition(params: Sequence[ParamSpec], world_size: int, bucket_numel: int) -> Partition:
    """Lay ``params`` (in optimizer order) out in buckets and shards; see the module docstring.

    Raises:
        ValueError: if ``world_size`` or ``bucket_numel`` is not positive, or the param
            groups are not contiguous and increasing (as ``torch.optim`` orders them).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    bucket_numel = _full_bucket_numel(world_size, bucket_numel)
    groups = [p.group for p in params]
    if groups != sorted(groups):
        raise ValueError(f"param groups must be contiguous and in order, got {groups}")

    buckets: List[Bucket] = []
    pieces: List[Piece] = []
    filled = 0
    key = None

    def close():
        nonlocal pieces, filled
        if filled:
            buckets.append(Bucket(len(buckets), key[0], key[1], filled, world_size, tuple(pieces)))
        pieces, filled = [], 0

    for index, spec in enumerate(params):
        if (spec.group, spec.kind) != key:
            close()
            key = (spec.group, spec.kind)
        done = 0
        while done < spec.numel:
            take = min(spec.numel - done, bucket_numel - filled)
            pieces.append(Piece(index, done, filled, take))
            done += take
            filled += take
            if filled == bucket_numel:
                close()
    close()
    return Partition(world_size, tuple(buckets), tuple(p.numel for p in params))

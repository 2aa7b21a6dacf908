"""Moving the sharded Adam state to one rank, for a checkpoint: the consolidation.

Owns the gathers of :meth:`ShardedAdam.consolidate_state_dict`: into memory (the plain
``torch.optim`` state dict on one rank), or streamed into a
:class:`~fairseq_oss.checkpoint_format.CheckpointWriter` on that rank, one bucket at a
time, so that its memory rises by one bucket whatever the model and world size. It reads
the optimizer's shards and layout and changes nothing in it. Tensors only, never pickles.
"""
import contextlib
from typing import Dict, List, Optional

import torch

from fairseq_oss import collectives
from fairseq_oss.checkpoint_format import RecordPlan, StorageRef, StreamedTensor


def bucket_buffers(opt) -> Dict[str, torch.Tensor]:
    """One bucket of state per kind, like ``opt``'s shards (dtype, device), reused by
    every gather or scatter of a pass."""
    shards = opt.state_shards()[0][1]
    sizes, first = {}, {}
    for b in opt.partition.buckets:
        sizes[b.kind] = max(sizes.get(b.kind, 0), b.numel)
        first.setdefault(b.kind, b.index)
    return {kind: shards[first[kind]].new_empty(n) for kind, n in sizes.items()}


def record_views(opt, seg, key: str, ref: StorageRef, views: Dict, placeholders: Dict) -> None:
    """Where segment ``seg``'s state ``key`` lies (record ``data/<ref.key>``): each of its
    parameters' entry in the manifest's ``views``, and, for stepped ones, the
    :class:`StreamedTensor` that stands in for it in the state dict."""
    for param, offset in seg.param_offsets:
        views.setdefault(str(param), {})[key] = [f"data/{ref.key}", offset]
        if opt.steps[param] > 0:
            placeholders.setdefault(param, {})[key] = StreamedTensor(ref, offset, opt.params[param].shape)


def state_plans(opt) -> List[RecordPlan]:
    """The state's records as :func:`stream_to_writer` writes them (one per segment and
    state key, in that order), each with this rank's shards as its parts: what
    :func:`fairseq_oss.parallel_write.write_records` writes instead of a gather."""
    plans = []
    for seg in opt.partition.segments():
        itemsize = torch.empty(0, dtype=_dtype(opt, seg)).element_size()
        for _, local in opt.state_shards():
            parts, at = [], 0  # at: the bucket's first element within the segment
            for bi in seg.buckets:
                b = opt.partition.buckets[bi]
                start, end = b.shard_range(opt.rank)
                if end > start:
                    parts.append(((at + start) * itemsize, local[b.index]))
                at += b.numel
            plans.append(RecordPlan(seg.numel * itemsize, parts))
    return plans


def placed_state(opt, writer, names: List[str]) -> Dict:
    """Rank 0, after the records of :func:`state_plans` were written as ``names``: the
    manifest's views (into ``writer``) and the stepped parameters' placeholders, as
    :func:`stream_to_writer` returns them."""
    placeholders: Dict[int, Dict] = {}
    views: Dict[str, Dict[str, list]] = {}
    names = iter(names)
    for seg in opt.partition.segments():
        for key, _ in opt.state_shards():
            ref = StorageRef(next(names).split("/", 1)[1], _dtype(opt, seg), seg.numel)
            record_views(opt, seg, key, ref, views, placeholders)
    writer.extra_manifest["optimizer_views"] = views
    return placeholders


def _dtype(opt, seg) -> torch.dtype:
    return opt.state_dtype(opt.params[seg.param_offsets[0][0]].dtype) if seg.param_offsets else torch.float32


def gather_in_memory(opt, recipient_rank: int) -> Optional[Dict[int, Dict[str, torch.Tensor]]]:
    """The full state of every stepped parameter, shaped like it, on ``recipient_rank``
    (None elsewhere): one bucket at a time, point to point into one reused buffer.

    .. warning:: Collective: call on all ranks of ``opt.process_group``.
    """
    is_recipient = opt.rank == recipient_rank
    full: Dict[int, Dict[str, torch.Tensor]] = {}
    if is_recipient:
        for i, p in enumerate(opt.params):
            if opt.steps[i] > 0:
                dtype = opt.state_dtype(p.dtype)
                full[i] = {
                    "exp_avg": torch.empty(p.shape, dtype=dtype, device=p.device),
                    "exp_avg_sq": torch.empty(p.shape, dtype=dtype, device=p.device),
                }
    out = opt.state_bucket_buffers() if is_recipient else {}
    for b in opt.partition.buckets:
        for key, local in opt.state_shards():
            gathered = collectives.gather_shards(
                local[b.index], opt.shard_ranges(b), recipient_rank, opt.process_group, out.get(b.kind)
            )
            if is_recipient:
                for pc in b.pieces:
                    if pc.param in full:
                        full[pc.param][key].view(-1)[
                            pc.param_offset : pc.param_offset + pc.numel
                        ].copy_(gathered[pc.offset : pc.offset + pc.numel])
    return full if is_recipient else None


def stream_to_writer(opt, recipient_rank: int, writer) -> Optional[Dict]:
    """Gather segment by segment, key by key, bucket by bucket; the recipient writes each
    bucket to ``writer`` as it arrives (one record per segment and state key) and gets
    back the :class:`StreamedTensor` placeholders of the stepped parameters; the other
    ranks only send, and get None. A write error on the recipient is raised after the
    last gather, so that no rank is left waiting in one; an error in a gather (a rank
    gone) propagates at once, leaving the record open for ``writer.abort()``.

    .. warning:: Collective: call on all ranks of ``opt.process_group``.
    """
    placeholders: Dict[int, Dict] = {}
    views: Dict[str, Dict[str, list]] = {}
    error = None
    out_buffers = opt.state_bucket_buffers() if opt.rank == recipient_rank else {}
    for seg in opt.partition.segments():
        dtype = _dtype(opt, seg)
        for key, local in opt.state_shards():
            ref = None
            with contextlib.ExitStack() as record:
                out = None
                if writer is not None and error is None:
                    try:
                        ref = StorageRef(writer.new_key(), dtype, seg.numel)
                        out = record.enter_context(writer.stream(f"data/{ref.key}"))
                    except Exception as e:  # noqa: BLE001 - raised after the gathers
                        error = e
                for bi in seg.buckets:
                    b = opt.partition.buckets[bi]
                    gathered = collectives.gather_shards(
                        local[b.index], opt.shard_ranges(b), recipient_rank, opt.process_group,
                        out_buffers.get(b.kind)
                    )
                    if out is not None and error is None:
                        try:
                            out.write(gathered[: b.numel])
                        except Exception as e:  # noqa: BLE001
                            error = e
            if ref is not None and error is None:
                record_views(opt, seg, key, ref, views, placeholders)
    if error is not None:
        raise error
    if writer is None:
        return None
    writer.extra_manifest["optimizer_views"] = views
    return placeholders

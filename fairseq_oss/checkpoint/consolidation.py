"""The sharded Adam state as records of a checkpoint: the consolidation.

Owns how the optimizer's state becomes records of the file: one record per segment and
state key, streamed into a :class:`~fairseq_oss.checkpoint.format.CheckpointWriter` on
one rank as it is gathered, one bucket at a time (so that rank's memory rises by one
bucket whatever the model and world size), or laid out for every rank to write its own
shards (:func:`state_plans`); and where each parameter's state lies in them (the
manifest's views, the placeholders in the state dict). It reads the optimizer's shards
and layout through its public accessors and changes nothing in it. Tensors only, never
pickles.
"""
import contextlib
from typing import Dict, List, Optional

import torch

from fairseq_oss.optim import collectives
from fairseq_oss.checkpoint.format import RecordPlan, StorageRef, StreamedTensor


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
    :func:`fairseq_oss.checkpoint.parallel_write.write_records` writes instead of a gather."""
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

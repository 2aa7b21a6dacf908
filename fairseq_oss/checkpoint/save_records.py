"""Who writes a save's large records: the Adam state and the model's weights.

Where every rank sees rank 0's temporary file (:func:`fairseq_oss.checkpoint.parallel_write.all_ranks_see`),
each rank writes its shards of the state and its 1/N of the weights into it
(:func:`fairseq_oss.checkpoint.parallel_write.write_records`). Otherwise rank 0 writes them all: the
state as it gathers it (:func:`fairseq_oss.checkpoint.consolidation.stream_to_writer`), then the
weights, which it holds. The records come in the same order either way (the state's, then
the weights'), so the file is the same, byte for byte, whoever wrote it and at any world
size. Owns that choice of path and the order; the bytes are the modules' named above.
"""
from typing import Dict, List, Optional

from fairseq_oss.checkpoint import consolidation, parallel_write
from fairseq_oss.checkpoint.format import CheckpointError, RecordPlan


def choose_parallel(opt, writer, shared_fs: bool) -> bool:
    """Whether the ranks write their own parts: a shared file system is allowed
    (not ``--oss-no-shared-fs``), there are several ranks, and every one sees the file.

    .. warning:: Collective: call on all ranks of ``opt.process_group``.
    """
    return shared_fs and opt.world_size > 1 and parallel_write.all_ranks_see(opt, writer)


def write(opt, writer, parallel: bool, weights=None) -> Optional[Dict]:
    """Write the state of ``opt`` (a ShardedAdam or a snapshot of one) and, if given,
    ``weights`` (:class:`~fairseq_oss.checkpoint.model_weights.ModelWeights`) into ``writer``
    (rank 0's; None elsewhere). Returns, on rank 0, the state's placeholders, as
    :func:`~fairseq_oss.checkpoint.consolidation.stream_to_writer` does, and sets ``weights.names``;
    None elsewhere.

    .. warning:: Collective: call on all ranks of ``opt.process_group``, with the
       ``parallel`` that :func:`choose_parallel` returned.
    """
    if parallel:
        state = consolidation.state_plans(opt)
        plans = state + (weights.plans(opt.rank, opt.world_size) if weights is not None else [])
        names = parallel_write.write_records(opt, writer, plans)
        if writer is None:
            return None
        if weights is not None:
            weights.names = names[len(state):]
        return consolidation.placed_state(opt, writer, names[: len(state)])
    placeholders = consolidation.stream_to_writer(opt, 0, writer)
    if writer is not None and weights is not None:
        weights.names = stream_plans(writer, weights.plans(0, 1))
    return placeholders


def stream_plans(writer, plans: List[RecordPlan]) -> List[str]:
    """Write records whose every part this process holds, in order; their names."""
    names = []
    for plan in plans:
        name = f"data/{writer.new_key()}"
        with writer.stream(name) as out:
            at = 0
            for pos, data in plan.pieces():
                if pos != at:
                    raise CheckpointError(f"{name}: a part starts at byte {pos}, not {at}")
                out.write(data)
                at += len(data)
            if at != plan.nbytes:
                raise CheckpointError(f"{name}: {at} bytes of {plan.nbytes} planned")
        names.append(name)
    return names

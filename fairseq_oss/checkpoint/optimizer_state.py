"""A :class:`~fairseq_oss.optim.ShardedAdam`'s state into a checkpoint file, and back.

Owns the two entry points by which a checkpoint takes an optimizer: saving its state
into a file that a :class:`~fairseq_oss.checkpoint.format.CheckpointWriter` is writing
(every rank its own shards where all ranks see the file, else streamed to rank 0 one
bucket at a time; :mod:`fairseq_oss.checkpoint.save_records`), and loading it, each rank
reading only its own slices (:mod:`fairseq_oss.checkpoint.state_loading`). Both work
through the optimizer's public accessors and change nothing in it but its state.
"""
from typing import Dict, Optional

from fairseq_oss.checkpoint import save_records, state_loading


def save_optimizer_state(opt, writer, *, shared_fs: bool = True, weights=None) -> Optional[Dict]:
    """Write ``opt``'s Adam state (and ``weights``, a
    :class:`~fairseq_oss.checkpoint.model_weights.ModelWeights`, if given) into the file
    of ``writer`` (rank 0's writer; None on the other ranks). With ``shared_fs`` and
    several ranks, every rank that sees the file writes its own part of it; otherwise
    rank 0 writes everything, gathering the state one bucket at a time. The bytes are
    the same either way.

    Returns:
        On rank 0, the optimizer's state dict in the plain Adam format, its tensors
        replaced by placeholders of the records written, for ``writer.finish``; None on
        the other ranks.

    .. warning:: Collective: call on all ranks of ``opt.process_group``.
    """
    parallel = save_records.choose_parallel(opt, writer, shared_fs)
    placeholders = save_records.write(opt, writer, parallel, weights)
    return opt.state_dict_of(placeholders) if writer is not None else None


def load_optimizer_state(opt, path: str, key: str = "last_optimizer_state", verify: bool = True,
                         shared_fs: bool = True) -> None:
    """Fill ``opt``'s shards from the state stored under ``key`` of the checkpoint at
    ``path``, saved at any world size, each rank reading only its own slices (with
    ``shared_fs=False``, rank 0 reads and sends each rank its slices).

    Raises:
        CheckpointError: on every rank, if any rank found the file unreadable,
            corrupted, or not matching ``opt``.

    .. warning:: Collective: call on all ranks of ``opt.process_group``.
    """
    state_loading.load_from_checkpoint(opt, path, key, verify, shared_fs)

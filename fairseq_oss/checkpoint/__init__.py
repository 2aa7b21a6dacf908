"""The checkpoint file: its format and index, the writes, the loads, file safety.

Owns the bytes on disk: a checkpoint is the zip that ``torch.save`` writes, plus a
manifest of per-chunk CRC32s (:mod:`.format`), read without loading it (:mod:`.index`).
It takes a :class:`~fairseq_oss.optim.ShardedAdam` and moves its shards, through the
optimizer's public accessors, into a file and back (:mod:`.optimizer_state`): streamed
to one rank (:mod:`.consolidation`), written by every rank in parallel
(:mod:`.parallel_write`, :mod:`.save_records`), in the background (:mod:`.async_save`),
the model's weights alike (:mod:`.model_weights`); loaded slice by slice
(:mod:`.state_loading`). Files are written safely (:mod:`.files`: temporaries, fsync,
rename, copies) and read safely (:mod:`.safe_load`: no code runs from a pickle). DTensor
models get state-dict hooks (:mod:`.sharded_tensors`).

It imports nothing of fairseq; :mod:`fairseq_oss.integration` calls it from fairseq's
save and load path. Public: :class:`CheckpointWriter`, :class:`CheckpointReader`,
:class:`CheckpointIndex`, :class:`CheckpointError`, :func:`save_optimizer_state`,
:func:`load_optimizer_state`.
"""
import importlib

_PUBLIC = {
    "CheckpointError": "format", "CheckpointReader": "format", "CheckpointWriter": "format",
    "CheckpointIndex": "index", "save_optimizer_state": "optimizer_state", "load_optimizer_state": "optimizer_state",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name):  # the public names, imported on first use (the tools need only a few modules)
    if name in _PUBLIC:
        return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

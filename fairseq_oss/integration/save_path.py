"""fairseq's save path for ``oss_adam``: every rank writes its part, once, durably.

Owns the places where fairseq's saving meets the sharded optimizer (see
``shared/notes/fairseq-integration.md`` for fairseq's side). Each patch does nothing
unless the trainer's optimizer is oss_adam. The bytes and the collectives are
:mod:`fairseq_oss.checkpoint`'s; this module decides when, and hands fairseq's objects
over. A save, in fairseq's order:

1. ``Trainer.consolidate_optimizer()`` (all ranks): rank 0 opens a
   :class:`~fairseq_oss.checkpoint.format.CheckpointWriter` in the save directory (if it
   cannot, every rank raises its error); then
   :func:`~fairseq_oss.checkpoint.save_optimizer_state` writes the Adam state and the
   weights (the model's, a criterion's, the EMA model's: :func:`weight_parts`) into it:
   every rank its own part if every rank sees the file (of the parameters'; the buffers,
   which ranks may hold differently, all by rank 0: :func:`parameters_of`), else
   (or with ``--oss-no-shared-fs``) streamed to rank 0 one bucket at a time. Same bytes
   either way. The optimizer's next ``state_dict()`` is the placeholders of what was
   written (:func:`fairseq_oss.integration.optimizer.prepare_state_dict`).
   With ``--write-checkpoints-asynchronously``: the previous background save is waited
   for on every rank, then each rank snapshots its part and a background job writes it
   (:mod:`fairseq_oss.checkpoint.async_save`).
2. ``Trainer.state_dict()`` (rank 0): the optimizer's entry holds those placeholders.
3. ``checkpoint_utils.torch_persistent_save`` (rank 0): the writer pickles the rest,
   writes the manifest and renames the file into place (fsync'd); asynchronously, the
   checkpoint is handed to the job, which does the same.
4. ``PathManager.copy`` of that file to ``checkpoint_last.pt`` etc.: an independent file
   (a reflink where the file system has them, else a copy), renamed into place, whoever
   wrote the source: never a hard link, never a write through an existing name
   (:func:`fairseq_oss.checkpoint.files.clone_or_copy`); asynchronously, made by the job
   after its commit, and so is fairseq's ``--keep-*`` pruning (:mod:`.pruning`).

Files written through ``torch_persistent_save`` for other optimizers go through a locked,
fsync'd temporary too. Models holding DTensors get the plugin's state-dict hooks
(:mod:`fairseq_oss.checkpoint.sharded_tensors`); every rank then calls
``Trainer.state_dict()`` during a save.
"""
import functools
import logging
import os
import sys
import threading
import time
from typing import Callable, Dict, Optional, Tuple

import torch
from fairseq import checkpoint_utils, utils
from fairseq.trainer import Trainer

from fairseq_oss import exit_handlers
from fairseq_oss.checkpoint import async_save, model_weights
from fairseq_oss.checkpoint.files import TemporaryFile, clone_or_copy
from fairseq_oss.checkpoint.format import CheckpointError, CheckpointWriter
from fairseq_oss.checkpoint.model_weights import MODEL, ModelWeights
from fairseq_oss.checkpoint.optimizer_state import save_optimizer_state
from fairseq_oss.checkpoint.sharded_tensors import has_dtensor, register_sharded_tensor_hooks
from fairseq_oss.integration import pruning
from fairseq_oss.integration.optimizer import (
    Unavailable,
    checkpoint_options,
    prepare_state_dict,
    sharded_optimizer,
    uses_oss_adam,
)
from fairseq_oss.integration import patching
from fairseq_oss.integration.patching import ORIGINAL
from fairseq_oss.optim import collectives

logger = logging.getLogger(__name__)

_STATE = threading.local()
# Set by the launcher (fairseq_oss.integration.launcher) for a run whose saves go to the background.
BACKGROUND = {"requested": False}


class _Pending:
    """Rank 0's save in progress, from ``consolidate_optimizer`` to ``torch_persistent_save``:
    its writer and the layout of the weights written into it (or None)."""

    def __init__(self, writer, weights):
        self.writer, self.weights = writer, weights


def _take_pending():
    pending = getattr(_STATE, "pending", None)
    _STATE.pending = None
    return pending


def _abort_pending():
    pending = _take_pending()
    if pending is not None:
        pending.writer.abort()


exit_handlers.register(_abort_pending)


# ---------------------------------------------------------------------- save


def consolidate_optimizer(self):
    """fairseq's ``Trainer.consolidate_optimizer`` (all ranks, first thing of a save):
    for oss_adam, the save's first step (see the module's docstring)."""
    inner = sharded_optimizer(self)
    if inner is None or self.cfg.checkpoint.no_save_optimizer_state:
        return ORIGINAL["consolidate_optimizer"](self)
    self._gathered_optim_state = None
    register_sharded_tensor_hooks(self.get_model())
    _abort_pending()
    world_size = self.data_parallel_world_size
    group = self.data_parallel_process_group if world_size > 1 else None
    if sys.exc_info()[0] is not None:  # fairseq's crash path: maybe only this rank is crashing
        async_save.wait_locally()  # so no collective here
        prepare_state_dict(inner, Unavailable())
        return
    if getattr(_STATE, "async_save", False):
        async_save.wait_and_agree(group, world_size)  # one save in flight, failures on every rank
        return _start_async_save(self, inner, group, world_size)
    writer = _open_writer(self, group, world_size)
    try:
        weights = model_weights_of(self)
        state = save_optimizer_state(inner, writer, shared_fs=checkpoint_options(self)["shared_fs"], weights=weights)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    prepare_state_dict(inner, state if writer is not None else Unavailable())
    _STATE.pending = _Pending(writer, weights) if writer is not None else None


def _open_writer(trainer, group, world_size):
    """Rank 0's CheckpointWriter (None elsewhere). If rank 0 cannot create its file (an
    unwritable or missing save directory, a full disk), every rank raises the same error.

    .. warning:: Collective: call on all ranks.
    """
    writer, error = None, None
    if trainer.data_parallel_rank == 0:
        directory = trainer.cfg.checkpoint.save_dir
        try:
            writer = CheckpointWriter(directory)
        except OSError as e:
            error = f"rank 0 cannot write a checkpoint in {directory}: {e}"
    if world_size > 1:
        error = collectives.broadcast_object(error, group, world_size)
    if error is not None:
        raise CheckpointError(error)
    return writer


# Where Trainer.state_dict() puts the weights besides the model's (model_weights.MODEL).
CRITERION = ("criterion",)
EMA, EMA_FP32 = ("extra_state", "ema"), ("extra_state", "ema_fp32_params")


def model_weights_of(trainer) -> Optional[ModelWeights]:
    """The records of what ``Trainer.state_dict()`` saves as weights (:func:`weight_parts`),
    on every rank, so that every rank writes 1/N of them; None where rank 0 must pickle
    them itself (DTensors: their state-dict hooks gather, in ``Trainer.state_dict()``)."""
    if has_dtensor(trainer.get_model()):
        return None
    parts = weight_parts(trainer)
    return ModelWeights.of_parts(parts, alike=parameters_of(trainer, parts))


def parameters_of(trainer, parts) -> Callable[[Tuple[str, ...], str, torch.Tensor], bool]:
    """Whether an entry of ``parts`` (:func:`weight_parts`) is a parameter's (of the model,
    the criterion or the EMA model, or an EMA parameter's float32 copy): those every rank
    holds alike, the same update of the same values. Buffers need not be: BatchNorm's
    running statistics come from each rank's own batches (``--broadcast-buffers``, off by
    default, copies rank 0's at each forward, which then updates them again), and fairseq
    saves rank 0's."""
    modules = [trainer.model, trainer.criterion] + ([trainer.ema.get_model()] if EMA in parts else [])
    storages = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
    ema = parts.get(EMA, {})

    def alike(path, name, t):
        if path == EMA_FP32:  # a copy, keyed by the EMA's name: alike where the EMA's own tensor is
            t = ema.get(name)
        return torch.is_tensor(t) and t.untyped_storage().data_ptr() in storages

    return alike


def weight_parts(trainer) -> Dict[Tuple[str, ...], dict]:
    """What fairseq's ``Trainer.state_dict()`` saves of the weights, by path in the
    checkpoint: the model's, a criterion's with parameters, and with ``--store-ema`` the EMA
    model's and (``--ema-fp32``) its float32 copies, which fairseq's EMA computes on every
    rank from the same parameters. The same tensors, in the same order, as ``state_dict()``
    puts there; which of them every rank holds alike is :func:`parameters_of`'s to say."""
    parts = {MODEL: trainer.model.state_dict()}
    if utils.has_parameters(trainer.criterion):
        parts[CRITERION] = trainer.criterion.state_dict()
    ema = trainer.cfg.ema
    if ema.store_ema:
        parts[EMA] = trainer.ema.get_model().state_dict()
        if ema.ema_fp32:
            parts[EMA_FP32] = trainer.ema.fp32_params
    return parts


def _start_async_save(trainer, inner, group, world_size):
    """Snapshot this rank's shards and its part of the weights (blocking) and start its
    background job; rank 0's job gets the rest of the checkpoint from torch_persistent_save."""
    started = time.perf_counter()
    writer = _open_writer(trainer, group, world_size)
    try:
        job = async_save.begin(inner, writer, model_weights_of(trainer), group, world_size,
                               checkpoint_options(trainer)["shared_fs"])
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    prepare_state_dict(inner, async_save.pending_state_dict(inner) if writer is not None else Unavailable())
    logger.info("oss_adam: checkpoint snapshot taken in %.2f s (%.1f MiB on this rank); written in the "
                "background", time.perf_counter() - started, job.snapshot.nbytes / 2**20)


def torch_persistent_save(obj, filename, async_write: bool = False):
    job = async_save.current()
    if getattr(_STATE, "async_save", False) and job is not None and job.writer is not None and job.path is None:
        job.hand_off(obj, filename)  # copied now; written by the job
        return
    pending = _take_pending()
    writer = pending.writer if pending is not None else None
    if isinstance(obj, dict) and isinstance(obj.get("last_optimizer_state"), Unavailable):
        logger.warning(
            "%s is written without optimizer state: it was requested while an exception was "
            "being handled (possibly on one rank only), where gathering the sharded state "
            "could hang the other ranks", filename,
        )
        obj = {k: v for k, v in obj.items() if k != "last_optimizer_state"}
    if writer is None:
        if async_write or checkpoint_utils.PathManager.path_requires_pathmanager(filename):
            return ORIGINAL["torch_persistent_save"](obj, filename, async_write)
        tmp = TemporaryFile(os.path.dirname(os.path.abspath(filename)))
        try:
            torch.save(obj, tmp.file)
            tmp.commit(filename)
        except BaseException:
            tmp.discard()
            raise
        return
    if async_write:
        logger.info("oss_adam writes %s synchronously (its state streams from all ranks)", filename)
    try:
        writer.finish(model_weights.with_placeholders(model_weights.with_shell(obj, pending.weights),
                                                      pending.weights), filename)
    except BaseException:
        writer.abort()
        raise


class _CopyingPathManager:
    """fairseq's PathManager, but ``copy`` between local paths makes an independent file
    (reflink or copy) renamed over the destination: fairseq's own ``shutil.copyfile``
    writes *through* the destination, which changes every file hard-linked to it."""

    def __init__(self, path_manager):
        self._pm = path_manager

    def __getattr__(self, name):
        return getattr(self._pm, name)

    def copy(self, src_path, dst_path, overwrite=False, **kwargs):
        if self._pm.path_requires_pathmanager(src_path) or self._pm.path_requires_pathmanager(dst_path):
            return self._pm.copy(src_path, dst_path, overwrite, **kwargs)
        job = async_save.current()
        if job is not None and job.path == os.path.abspath(src_path):
            job.add_copy(dst_path)  # made by the job once src is committed
            return True
        clone_or_copy(src_path, dst_path)
        return True


def save_checkpoint(cfg, trainer, epoch_itr, val_loss):
    """fairseq's, timed whole for oss_adam: fairseq's "writing took" starts after the
    optimizer state was gathered (and, for oss_adam, mostly written)."""
    if not uses_oss_adam(trainer):
        return ORIGINAL["save_checkpoint"](cfg, trainer, epoch_itr, val_loss)
    start = time.perf_counter()
    background = bool(cfg.write_checkpoints_asynchronously or BACKGROUND["requested"])
    background = background and not trainer.cfg.checkpoint.no_save_optimizer_state
    # Asynchronously, the job writes the file and then its copies: fairseq must ask for the
    # copies (its own asynchronous mode skips them) and hand the checkpoint over as for a
    # synchronous save.
    requested, cfg.write_checkpoints_asynchronously = cfg.write_checkpoints_asynchronously, False
    # fairseq prunes old checkpoints (--keep-*) right after the save; asynchronously the new
    # file has no final name yet then, so pruning waits for the job's commit.
    rules = pruning.KeepRules.of(cfg, trainer.checkpoint_suffix, epoch_itr.end_of_epoch())
    keep = {k: getattr(cfg, k) for k in pruning.KEEP_FLAGS}
    if background:
        for k in keep:
            setattr(cfg, k, 0)
    _STATE.async_save = background
    try:
        result = ORIGINAL["save_checkpoint"](cfg, trainer, epoch_itr, val_loss)
        if background and rules.prunes and trainer.should_save_checkpoint_on_current_rank and not cfg.no_save:
            job = async_save.current()
            if job is not None and job.path is not None:
                job.after_commit(functools.partial(pruning.prune, rules))
            else:  # no file handed over this time: every earlier one is committed
                pruning.prune(rules)
    finally:
        cfg.write_checkpoints_asynchronously = requested
        for k, v in keep.items():
            setattr(cfg, k, v)
        _STATE.async_save = False
        job = async_save.current()
        if job is not None:
            job.close_copies()
    if trainer.should_save_checkpoint_on_current_rank and not cfg.no_save:
        logger.info(
            "oss_adam: the checkpoint save %s %.2f seconds%s", "blocked training for" if background else "took",
            time.perf_counter() - start,
            " (the file and its copies are written in the background)" if background else
            " in all (gathering and writing the optimizer state, the rest of the file and its copies)",
        )
    return result


def always_call_state_dict_during_save_checkpoint(self) -> bool:
    """Also every rank when the model holds DTensors: their hooks gather full tensors,
    a collective (fairseq's own use of this property is FSDP's)."""
    original = ORIGINAL["always_call_state_dict_during_save_checkpoint"].fget(self)
    return original or (uses_oss_adam(self) and has_dtensor(self.get_model()))


PATCHES = [
    (Trainer, "consolidate_optimizer", consolidate_optimizer),
    (checkpoint_utils, "torch_persistent_save", torch_persistent_save),
    (checkpoint_utils, "save_checkpoint", save_checkpoint),
    (Trainer, "always_call_state_dict_during_save_checkpoint", property(always_call_state_dict_during_save_checkpoint)),
]


def wrap_path_manager() -> None:
    """fairseq's checkpoint_utils.PathManager, with copies that never write through."""
    if not isinstance(checkpoint_utils.PathManager, _CopyingPathManager):
        checkpoint_utils.PathManager = _CopyingPathManager(checkpoint_utils.PathManager)


patching.apply(PATCHES)
wrap_path_manager()

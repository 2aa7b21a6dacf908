"""fairseq's save and load path for ``oss_adam``: streamed save, sliced load, integrity.

Owns the places where fairseq's checkpointing meets the sharded optimizer (see
``shared/notes/fairseq-integration.md`` for fairseq's side). Each patch below does
nothing unless the trainer's optimizer is a :class:`~fairseq_oss.sharded_adam.ShardedAdam`
(``cfg.optimizer._name == "oss_adam"`` on the load side, before it is built). Importing
this module applies them.

Save, in fairseq's order:

1. ``Trainer.consolidate_optimizer()`` (all ranks): rank 0 opens a
   :class:`~fairseq_oss.checkpoint_format.CheckpointWriter` in the save directory; if
   every rank sees its file, each rank writes its own shard of the Adam state into it
   (:mod:`fairseq_oss.parallel_write`), else (or with ``--oss-no-shared-fs``) the ranks
   stream the state to rank 0, one bucket at a time. Same bytes either way.
2. ``Trainer.state_dict()`` (rank 0): the optimizer's entry holds placeholders.
3. ``checkpoint_utils.torch_persistent_save`` (rank 0): the writer pickles the rest,
   writes the manifest and renames the file into place (fsync'd).
4. ``PathManager.copy`` of that file to ``checkpoint_last.pt`` etc.: an independent file
   (a reflink where the file system has them, else a copy), renamed into place, whoever
   wrote the source: never a hard link, never a write through an existing name
   (:func:`fairseq_oss.files.clone_or_copy`).

Files written through ``torch_persistent_save`` for other optimizers go through a locked,
fsync'd temporary too.

Both register the plugin's state-dict hooks on the model
(:mod:`fairseq_oss.sharded_tensors`): DTensor parameters are saved full and re-sharded
when loaded; with DTensors, every rank calls ``Trainer.state_dict()`` during a save.

Load:

1. ``Trainer.load_checkpoint`` (all ranks): every rank says what it sees at the path
   (nothing, or a file and its fingerprint); rank 0 checks that its file opens, holds no
   type a safe load refuses (:mod:`fairseq_oss.safe_load`) and that every record outside
   the optimizer state matches its checksum. Every rank decides the same from those
   facts: a bad file stops all ranks with the same message instead of hanging them; a
   rank that sees no file or another one (no shared file system, a stale copy on one
   node) gets everything from rank 0 (logged), never its own file's state.
2. ``checkpoint_utils.load_checkpoint_to_cpu``: the file is mapped, not read, and its
   optimizer state is replaced by an :class:`OptimizerStateFile` handle. With a shared
   file system (the default) every rank maps the file itself, as fairseq's
   ``--load-checkpoint-on-all-dp-ranks`` does, and nothing is broadcast; with
   ``--oss-no-shared-fs`` rank 0 maps it and fairseq broadcasts the model and the handle.
   The weights' pages are released as the model copies them in (:class:`MappedPages`).
3. ``optimizer.load_state_dict(handle)`` (all ranks): each rank maps the file and copies
   its own slices (``ShardedAdam.load_from_checkpoint``).
"""
import atexit
import contextlib
import functools
import logging
import os
import pickle
import socket
import sys
import threading
import time
from typing import Optional

import torch
from fairseq import checkpoint_utils
from fairseq.distributed import utils as distributed_utils
from fairseq import trainer as trainer_module
from fairseq.trainer import Trainer
from omegaconf import OmegaConf

from fairseq_oss import compat  # noqa: F401 - its launch fixes first: call_main is wrapped over them
from fairseq_oss import async_save, collectives, model_weights, optimizer, pruning, safe_load
from fairseq_oss.checkpoint_format import (
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
    MappedPages,
    OptimizerStateFile,
    fingerprint,
    load_mmap,
)
from fairseq_oss.files import TemporaryFile, clone_or_copy
from fairseq_oss.model_weights import ModelWeights
from fairseq_oss.sharded_adam import UNAVAILABLE, ShardedAdam
from fairseq_oss.sharded_tensors import has_dtensor, register_sharded_tensor_hooks

logger = logging.getLogger(__name__)

_ORIGINAL = {}
_STATE = threading.local()


def sharded_optimizer(trainer):
    """The trainer's ShardedAdam, or None (without building the optimizer)."""
    opt = getattr(trainer, "_optimizer", None)
    try:
        inner = opt.optimizer if opt is not None else None
    except (NotImplementedError, ValueError, AttributeError):
        return None
    return inner if isinstance(inner, ShardedAdam) else None


def _uses_oss_adam(trainer) -> bool:
    name = OmegaConf.select(trainer.cfg, "optimizer._name") if OmegaConf.is_config(trainer.cfg) else None
    return name == "oss_adam" or sharded_optimizer(trainer) is not None


def _options(trainer):
    opt_cfg = trainer.cfg.optimizer
    return {
        "verify": not bool(getattr(opt_cfg, "oss_skip_checksums", False)),
        "shared_fs": not bool(getattr(opt_cfg, "oss_no_shared_fs", False)),
    }


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


atexit.register(_abort_pending)


# ---------------------------------------------------------------------- save


def consolidate_optimizer(self):
    inner = sharded_optimizer(self)
    if inner is None or self.cfg.checkpoint.no_save_optimizer_state:
        return _ORIGINAL["consolidate_optimizer"](self)
    self._gathered_optim_state = None
    register_sharded_tensor_hooks(self.get_model())
    _abort_pending()
    world_size = self.data_parallel_world_size
    group = self.data_parallel_process_group if world_size > 1 else None
    crashing = sys.exc_info()[0] is not None
    if crashing:
        async_save.wait_locally()  # no collective here: maybe only this rank is crashing
    elif getattr(_STATE, "async_save", False):
        async_save.wait_and_agree(group, world_size)  # one save in flight, failures on every rank
        return _start_async_save(self, inner, group, world_size)
    writer = None if crashing else _open_writer(self, group, world_size)
    try:
        weights = None if crashing else model_weights_of(self)
        inner.consolidate_state_dict(recipient_rank=0, writer=writer, stream=True,
                                     parallel=_options(self)["shared_fs"], weights=weights)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
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


def model_weights_of(trainer) -> Optional[ModelWeights]:
    """The records of what ``Trainer.state_dict()`` saves as the model, on every rank, so
    that every rank writes 1/N of them; None where rank 0 must pickle the model itself
    (DTensors: their state-dict hooks gather, in ``Trainer.state_dict()``)."""
    if has_dtensor(trainer.get_model()):
        return None
    return ModelWeights.of(trainer.model.state_dict())


def _start_async_save(trainer, inner, group, world_size):
    """Snapshot this rank's shards and its part of the weights (blocking) and start its
    background job; rank 0's job gets the rest of the checkpoint from torch_persistent_save."""
    started = time.perf_counter()
    writer = _open_writer(trainer, group, world_size)
    try:
        job = async_save.begin(inner, writer, model_weights_of(trainer), group, world_size,
                               _options(trainer)["shared_fs"])
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    logger.info("oss_adam: checkpoint snapshot taken in %.2f s (%.1f MiB on this rank); written in the "
                "background", time.perf_counter() - started, job.snapshot.nbytes / 2**20)


def torch_persistent_save(obj, filename, async_write: bool = False):
    job = async_save.current()
    if getattr(_STATE, "async_save", False) and job is not None and job.writer is not None and job.path is None:
        job.hand_off(obj, filename)  # copied now; written by the job
        return
    pending = _take_pending()
    writer = pending.writer if pending is not None else None
    if isinstance(obj, dict) and obj.get("last_optimizer_state") is UNAVAILABLE:
        logger.warning(
            "%s is written without optimizer state: it was requested while an exception was "
            "being handled (possibly on one rank only), where gathering the sharded state "
            "could hang the other ranks", filename,
        )
        obj = {k: v for k, v in obj.items() if k != "last_optimizer_state"}
    if writer is None:
        if async_write or checkpoint_utils.PathManager.path_requires_pathmanager(filename):
            return _ORIGINAL["torch_persistent_save"](obj, filename, async_write)
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
    if not _uses_oss_adam(trainer):
        return _ORIGINAL["save_checkpoint"](cfg, trainer, epoch_itr, val_loss)
    start = time.perf_counter()
    background = bool(cfg.write_checkpoints_asynchronously or _ASYNC["requested"])
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
    job = None
    try:
        result = _ORIGINAL["save_checkpoint"](cfg, trainer, epoch_itr, val_loss)
        job = async_save.current()
        if background and rules.prunes and trainer.should_save_checkpoint_on_current_rank and not cfg.no_save:
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


_ASYNC = {"requested": False}


def call_main(cfg, main, **kwargs):
    """fairseq's launcher (fairseq-train, fairseq-hydra-train), with oss_adam taking over
    ``--write-checkpoints-asynchronously``: fairseq's own mode needs iopath (without it,
    fairseq-train returns at once, having trained nothing), skips the copies and does not
    wait for the last save. Each rank runs :func:`train_with_async_saves`. A configuration
    that oss_adam refuses (:func:`fairseq_oss.optimizer.refusal`) exits here, in one line."""
    optimizer.drop_settings_of_oss_adam(cfg)
    problem = optimizer.refusal(cfg)
    if problem is not None:  # before any rank is spawned, model built or data read
        sys.exit(f"{os.path.basename(sys.argv[0]) or 'fairseq'}: error: {problem}")
    ckpt = cfg.checkpoint
    if OmegaConf.select(cfg, "optimizer._name") == "oss_adam" and ckpt.write_checkpoints_asynchronously:
        ckpt.write_checkpoints_asynchronously = False
        main = functools.partial(train_with_async_saves, main)
    return _ORIGINAL["call_main"](cfg, main, **kwargs)


def train_with_async_saves(main, cfg, **kwargs):
    """``main(cfg)`` with every save written in the background, then waits for the last
    one: training ends only once it is complete, and fails if it failed."""
    _ASYNC["requested"] = True
    try:
        result = main(cfg, **kwargs)
    except BaseException:
        async_save.wait_locally()
        raise
    finally:
        _ASYNC["requested"] = False
    error = async_save.wait_locally()
    if error is not None:
        raise CheckpointError(f"the last asynchronous checkpoint save failed: {type(error).__name__}: {error}")
    return result


# ---------------------------------------------------------------------- load


def load_checkpoint(self, filename, reset_optimizer=False, *args, **kwargs):
    if not _uses_oss_adam(self):
        return _ORIGINAL["load_checkpoint"](self, filename, reset_optimizer, *args, **kwargs)
    world_size = self.data_parallel_world_size
    group = self.data_parallel_process_group if world_size > 1 else None
    options = _options(self)
    # What each rank sees at this path, and rank 0's verdict on its own file; every rank
    # then takes the same decision from the same facts (no rank can go its own way and
    # leave the others waiting in a collective).
    seen = collectives.all_gather_objects((socket.gethostname(), _describe(filename)), group, world_size)
    verdict = _preflight(filename, verify=options["verify"]) if self.data_parallel_rank == 0 else None
    verdict = collectives.broadcast_object(verdict, group, world_size)
    mode = _decide(filename, verdict, seen, options["shared_fs"])
    if mode == "absent":
        return _ORIGINAL["load_checkpoint"](self, filename, reset_optimizer, *args, **kwargs)
    ckpt_cfg = self.cfg.checkpoint
    on_all_ranks = ckpt_cfg.load_checkpoint_on_all_dp_ranks
    try:
        # Every rank takes fairseq's "the file exists" path, since rank 0 has it: a rank
        # that does not see it gets the model from rank 0's broadcast.
        _STATE.exists = os.path.abspath(filename)
        # "shared": every rank maps the file itself (fairseq's
        # --load-checkpoint-on-all-dp-ranks): no pickled model in flight, and the
        # weights' pages come from the page cache. Otherwise only rank 0 reads.
        ckpt_cfg.load_checkpoint_on_all_dp_ranks = mode == "shared" and world_size > 1
        if mode == "legacy":  # torch's legacy format: fairseq's own path, on rank 0
            return _ORIGINAL["load_checkpoint"](self, filename, reset_optimizer, *args, **kwargs)
        register_sharded_tensor_hooks(self.get_model())
        read = dict(options, shared_fs=mode == "shared")
        _STATE.loading = (os.path.abspath(filename), None if reset_optimizer else read)
        with releasing_mapped_weights(self.get_model(), lambda: getattr(_STATE, "model_pages", None)):
            return _ORIGINAL["load_checkpoint"](self, filename, reset_optimizer, *args, **kwargs)
    finally:
        ckpt_cfg.load_checkpoint_on_all_dp_ranks = on_all_ranks
        _STATE.exists = None
        _STATE.loading = None
        _STATE.model_pages = None


def _describe(path):
    """What this rank sees at ``path``: None (nothing), ("legacy",), ("zip", size,
    fingerprint) or ("unreadable", message). Never raises."""
    try:
        if not os.path.isfile(path):
            return None
        with open(path, "rb") as f:
            if f.read(2) != b"PK":
                return ("legacy",)
        return ("zip", os.path.getsize(path), fingerprint(path))
    except (OSError, CheckpointError) as e:
        return ("unreadable", str(e))


def _decide(path, verdict, seen, shared_fs) -> str:
    """From rank 0's verdict and what every rank sees, the same on every rank: "absent"
    (nothing to load), "legacy", "shared" (every rank reads the file) or "from_rank0"
    (rank 0 reads and sends). Raises CheckpointError (on every rank) where none can go on."""
    host0, view0 = seen[0]
    if verdict == "absent":
        others = [f"rank {r} on {host}" for r, (host, view) in enumerate(seen) if view is not None]
        if others:
            raise CheckpointError(
                f"{path}: rank 0 on {host0} sees no checkpoint there, but {', '.join(others)} "
                "do(es): the ranks do not agree on what to resume from. Make the file visible to "
                "rank 0 (or remove it from the other nodes to start afresh)."
            )
        return "absent"
    if verdict not in ("ok", "legacy"):
        raise CheckpointError(verdict)
    if verdict == "legacy":
        return "legacy"
    differ = [(r, host, view) for r, (host, view) in enumerate(seen) if view != view0]
    if differ:
        what = "; ".join(
            f"rank {r} on {host} " + ("sees no file" if view is None else
                                      "sees another file" if view[0] != "unreadable" else
                                      f"cannot read it ({view[1]})")
            for r, host, view in differ
        )
        logger.warning(
            "%s: not every rank sees rank 0's file (%s): rank 0 reads it and sends every rank "
            "the model and its slices of the optimizer state (as with --oss-no-shared-fs)", path, what,
        )
        return "from_rank0"
    return "shared" if shared_fs else "from_rank0"


class _RankZeroViewPathManager:
    """fairseq's PathManager for the trainer: during a load, ``isfile`` of the checkpoint
    answers rank 0's view (it exists), so that every rank takes the same path."""

    def __init__(self, path_manager):
        self._pm = path_manager

    def __getattr__(self, name):
        return getattr(self._pm, name)

    def isfile(self, path):
        exists = getattr(_STATE, "exists", None)
        if exists is not None and os.path.abspath(path) == exists:
            return True
        return self._pm.isfile(path)


@contextlib.contextmanager
def releasing_mapped_weights(model, pages):
    """While ``model`` loads a state dict whose tensors are mapped from a file, give the
    pages copied so far back before each module loads its own, and after the last one:
    the process then holds about one module's pages of the file at a time, not the whole
    model's. ``pages()`` returns the :class:`MappedPages` of the state dict's tensors (or
    None: nothing to release), and is asked at each module, since fairseq maps the file
    only once the load has begun."""

    def release(*_):
        mapped = pages()
        if mapped is not None:
            mapped.release()

    hooks = [m.register_load_state_dict_pre_hook(release) for m in model.modules()]
    hooks.append(model.register_load_state_dict_post_hook(release))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _preflight(path, verify) -> str:
    """'absent', 'legacy' (not a zip), 'ok' (the file opens, it holds no type that a safe
    load refuses, and every record outside the optimizer state has the checksum the
    manifest recorded; the optimizer's slices are checked by their readers), or the
    error message."""
    if not os.path.isfile(path):
        return "absent"
    with open(path, "rb") as f:
        head = f.read(2)
    if head[:1] == b"\x80":  # a pickle: torch's legacy format
        return "legacy"
    if head != b"PK":
        return f"{path}: not a readable checkpoint (neither a zip nor a legacy torch file)"
    try:
        reader = CheckpointReader(path)
        refused = None if safe_load.trusted() else safe_load.refusal(path)
        if refused:
            return refused
        if verify and reader.manifest is not None:
            optimizer_records = {
                record for views in reader.manifest.get("optimizer_views", {}).values() for record, _ in views.values()
            }
            reader.verify_all_except(optimizer_records)
    except CheckpointError as e:
        return str(e)
    return "ok"


def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
    loading = getattr(_STATE, "loading", None)
    if loading is None or arg_overrides is not None or os.path.abspath(path) != loading[0]:
        try:
            return _ORIGINAL["load_checkpoint_to_cpu"](path, arg_overrides, load_on_all_ranks)
        except pickle.UnpicklingError as e:  # fairseq's torch.load refused the file
            raise CheckpointError(safe_load.refusal(path, e)) from None
    state = load_mmap(path)
    has_optimizer_state = isinstance(state.get("last_optimizer_state"), dict)
    if state.get("cfg") is not None:
        state["cfg"] = OmegaConf.create(state["cfg"], flags={"allow_objects": True})
    state = checkpoint_utils._upgrade_state_dict(state)
    if isinstance(state.get("model"), dict):
        _STATE.model_pages = MappedPages([t for t in state["model"].values() if torch.is_tensor(t)])
    options = loading[1]
    if options is None and has_optimizer_state:  # --reset-optimizer: nothing to read or broadcast
        state["last_optimizer_state"] = None
    elif has_optimizer_state:
        saved = state["last_optimizer_state"]
        extras = {k: v for k, v in saved.items() if k not in ("state", "param_groups")}
        state["last_optimizer_state"] = OptimizerStateFile(path, extras=extras, **options)
    return state


def always_call_state_dict_during_save_checkpoint(self) -> bool:
    """Also every rank when the model holds DTensors: their hooks gather full tensors,
    a collective (fairseq's own use of this property is FSDP's)."""
    original = _ORIGINAL["always_call_state_dict_during_save_checkpoint"].fget(self)
    return original or (_uses_oss_adam(self) and has_dtensor(self.get_model()))


# ---------------------------------------------------------------------- install

_PATCHES = [
    (Trainer, "consolidate_optimizer", consolidate_optimizer),
    (Trainer, "load_checkpoint", load_checkpoint),
    (checkpoint_utils, "torch_persistent_save", torch_persistent_save),
    (checkpoint_utils, "save_checkpoint", save_checkpoint),
    (distributed_utils, "call_main", call_main),
    (checkpoint_utils, "load_checkpoint_to_cpu", load_checkpoint_to_cpu),
    (Trainer, "always_call_state_dict_during_save_checkpoint", property(always_call_state_dict_during_save_checkpoint)),
]


def apply() -> None:
    """Install the patches once; later calls do nothing. Importing this module calls it."""
    for owner, name, replacement in _PATCHES:
        if name not in _ORIGINAL:
            _ORIGINAL[name] = getattr(owner, name)
            setattr(owner, name, replacement)
    if not isinstance(checkpoint_utils.PathManager, _CopyingPathManager):
        checkpoint_utils.PathManager = _CopyingPathManager(checkpoint_utils.PathManager)
    if not isinstance(trainer_module.PathManager, _RankZeroViewPathManager):
        trainer_module.PathManager = _RankZeroViewPathManager(trainer_module.PathManager)
    safe_load.allow_fairseq_types()


apply()

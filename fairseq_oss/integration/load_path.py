"""fairseq's load path for ``oss_adam``: the ranks agree on the file, each reads its slice.

Owns the places where fairseq's loading meets the sharded optimizer. Each patch does
nothing unless the trainer trains with oss_adam (``cfg.optimizer._name``, asked before the
optimizer is built). A load, in fairseq's order:

1. ``Trainer.load_checkpoint`` (all ranks): every rank says what it sees at the path
   (nothing, or a file and its fingerprint); rank 0 checks that its file opens, holds no
   type a safe load refuses (:mod:`fairseq_oss.checkpoint.safe_load`) and that every
   record outside the optimizer state matches its checksum. Every rank decides the same
   from those facts: a bad file stops all ranks with the same message instead of hanging
   them; a rank that sees no file or another one (no shared file system, a stale copy on
   one node) gets everything from rank 0 (logged), never its own file's state.
2. ``checkpoint_utils.load_checkpoint_to_cpu``: the file is mapped, not read, and its
   optimizer state is replaced by an
   :class:`~fairseq_oss.checkpoint.format.OptimizerStateFile` handle. With a shared file
   system (the default) every rank maps the file itself, as fairseq's
   ``--load-checkpoint-on-all-dp-ranks`` does, and nothing is broadcast; with
   ``--oss-no-shared-fs`` rank 0 maps it and fairseq broadcasts the model and the handle.
   The weights' pages are released as the model copies them in
   (:class:`~fairseq_oss.checkpoint.format.MappedPages`).
3. ``optimizer.load_state_dict(handle)`` (all ranks): oss_adam's
   (:class:`~fairseq_oss.integration.optimizer.FairseqOSSAdam`) has every rank read its
   own slices (:func:`~fairseq_oss.checkpoint.load_optimizer_state`).
"""
import contextlib
import logging
import os
import pickle
import socket
import threading

import torch
from fairseq import checkpoint_utils
from fairseq import trainer as trainer_module
from fairseq.trainer import Trainer
from omegaconf import OmegaConf

from fairseq_oss.checkpoint import safe_load
from fairseq_oss.checkpoint.format import (
    CheckpointError,
    CheckpointReader,
    MappedPages,
    OptimizerStateFile,
    fingerprint,
    load_mmap,
)
from fairseq_oss.checkpoint.sharded_tensors import register_sharded_tensor_hooks
from fairseq_oss.integration.optimizer import checkpoint_options, uses_oss_adam
from fairseq_oss.integration import patching
from fairseq_oss.integration.patching import ORIGINAL
from fairseq_oss.optim import collectives

logger = logging.getLogger(__name__)

_STATE = threading.local()


def load_checkpoint(self, filename, reset_optimizer=False, *args, **kwargs):
    if not uses_oss_adam(self):
        return ORIGINAL["load_checkpoint"](self, filename, reset_optimizer, *args, **kwargs)
    world_size = self.data_parallel_world_size
    group = self.data_parallel_process_group if world_size > 1 else None
    options = checkpoint_options(self)
    # What each rank sees at this path, and rank 0's verdict on its own file; every rank
    # then takes the same decision from the same facts (no rank can go its own way and
    # leave the others waiting in a collective).
    seen = collectives.all_gather_objects((socket.gethostname(), _describe(filename)), group, world_size)
    verdict = _preflight(filename, verify=options["verify"]) if self.data_parallel_rank == 0 else None
    verdict = collectives.broadcast_object(verdict, group, world_size)
    mode = _decide(filename, verdict, seen, options["shared_fs"])
    if mode == "absent":
        return ORIGINAL["load_checkpoint"](self, filename, reset_optimizer, *args, **kwargs)
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
            return ORIGINAL["load_checkpoint"](self, filename, reset_optimizer, *args, **kwargs)
        register_sharded_tensor_hooks(self.get_model())
        read = dict(options, shared_fs=mode == "shared")
        _STATE.loading = (os.path.abspath(filename), None if reset_optimizer else read)
        with releasing_mapped_weights(self.get_model(), lambda: getattr(_STATE, "model_pages", None)):
            return ORIGINAL["load_checkpoint"](self, filename, reset_optimizer, *args, **kwargs)
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
            return ORIGINAL["load_checkpoint_to_cpu"](path, arg_overrides, load_on_all_ranks)
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


PATCHES = [
    (Trainer, "load_checkpoint", load_checkpoint),
    (checkpoint_utils, "load_checkpoint_to_cpu", load_checkpoint_to_cpu),
]


def wrap_path_manager() -> None:
    """The trainer's PathManager, answering rank 0's view of the file during a load."""
    if not isinstance(trainer_module.PathManager, _RankZeroViewPathManager):
        trainer_module.PathManager = _RankZeroViewPathManager(trainer_module.PathManager)


patching.apply(PATCHES)
wrap_path_manager()
safe_load.allow_fairseq_types()

"""The fairseq optimizer ``oss_adam``: a drop-in for ``--optimizer adam``.

Owns the registration with fairseq, the translation of fairseq's config into a
:class:`~fairseq_oss.optim.sharded_adam.ShardedAdam`, what oss_adam refuses of a config,
and the state dict that fairseq's wrappers see: the one a save prepared for the
checkpoint, or a checkpoint file's handle to load from. Its config *is* ``FairseqAdamConfig`` plus
the knobs below, so every flag of ``--optimizer adam`` works unchanged, with the same
defaults, and switching is changing one word.
"""
import logging
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
from fairseq import optim
from fairseq.distributed import utils as distributed_utils
from fairseq.dataclass import ChoiceEnum
from fairseq.optim import FairseqOptimizer, register_optimizer
from fairseq.optim.adam import FairseqAdam, FairseqAdamConfig
from omegaconf import OmegaConf, open_dict

from fairseq_oss.checkpoint.format import OptimizerStateFile
from fairseq_oss.checkpoint.optimizer_state import load_optimizer_state
from fairseq_oss.integration import grad_sync, malloc
from fairseq_oss.optim import bucket_size, collectives
from fairseq_oss.optim.grad_reduction import GradReducer, total_norm
from fairseq_oss.optim.sharded_adam import ShardedAdam, TooManyBuckets

logger = logging.getLogger(__name__)

@dataclass
class FairseqOSSAdamConfig(FairseqAdamConfig):
    oss_bucket_mb: float = field(
        default=bucket_size.DEFAULT_BUCKET_MB,
        metadata={
            "help": "size in MiB of one bucket of parameters or optimizer state moved by one "
            "collective (step all-gather, checkpoint consolidation); bounds the extra memory "
            "they need"
        },
    )
    oss_grad_reduction: ChoiceEnum(grad_sync.MODES) = field(
        default="auto",
        metadata={
            "help": "how gradients are summed across the data-parallel ranks. reduce_scatter: "
            "bucket by bucket during backward, each rank receiving the sum of its own shard only "
            "and keeping 1/N of the gradients (as many bytes per update as plain adam); "
            "all_reduce: fairseq's DDP all-reduce of every gradient, each rank keeping all "
            "of them (1.5x plain adam's bytes with the parameters' all-gather); auto: "
            "reduce_scatter in fp32, --fp16, --memory-efficient-fp16 or --amp training under "
            "pytorch_ddp, legacy_ddp or no_c10d, all_reduce otherwise"
        },
    )
    oss_skip_checksums: bool = field(
        default=False,
        metadata={"help": "do not verify the checksums of a fairseq-oss checkpoint when loading it"},
    )
    oss_no_shared_fs: bool = field(
        default=False,
        metadata={
            "help": "ranks do not share a file system: rank 0 reads the checkpoint and sends each "
            "rank its slice of the optimizer state, one bucket at a time"
        },
    )


@register_optimizer("oss_adam", dataclass=FairseqOSSAdamConfig)
class FairseqOSSAdam(FairseqOptimizer):
    """fairseq's Adam with its state sharded across the data-parallel ranks (ZeRO-1) and,
    with ``--oss-grad-reduction`` reduce_scatter (fp32's default), its gradients
    reduce-scattered into each rank's shard during backward (ZeRO-2): then
    ``all_reduce_grads``, ``multiply_grads`` and ``clip_grad_norm`` work on the shards.

    Checkpoints hold the state un-sharded, in the format ``--optimizer adam`` writes;
    the trainer's ``consolidate_optimizer()`` gathers it before a save.
    """

    def __init__(self, cfg: FairseqOSSAdamConfig, params):
        super().__init__(cfg)
        if getattr(cfg, "fp16_adam_stats", False):
            raise NotImplementedError("--fp16-adam-stats is not supported by oss_adam")
        if getattr(cfg, "tpu", False):
            raise NotImplementedError("oss_adam does not support TPUs")
        group = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            group = distributed_utils.get_data_parallel_group()
        try:
            self._optimizer = ShardedAdam(
                params,
                **self.optimizer_config,
                process_group=group,
                bucket_bytes=bucket_size.bucket_bytes(cfg.oss_bucket_mb, BUCKET_FLAG),
                max_buckets=bucket_size.MAX_BUCKETS,
            )
        except TooManyBuckets as e:
            raise ValueError(bucket_size.count_refusal(e.count, e.total_bytes, cfg.oss_bucket_mb, BUCKET_FLAG)) from None
        # The reduce-scatter, where a ShardedGradDataParallel (not fairseq's DDP) holds the
        # parameters: nothing else reduces them then. (Under --fp16 it holds the model's
        # fp16 parameters, not these: see reduce_in_shards.)
        self._reducer = None
        self.reduce_in_shards(self._optimizer.params)
        device = next(iter(self._optimizer._params), torch.empty(0)).device
        per_rank = collectives.all_gather_ints(self._optimizer.state_bytes(), group, device)
        logger.info(
            "oss_adam: Adam state sharded over %d rank(s) in %d bucket(s): %s MiB per rank "
            "(plain adam: %.2f MiB on every rank)",
            len(per_rank),
            len(self._optimizer.partition.buckets),
            ", ".join(f"{b / 2**20:.2f}" for b in per_rank),
            sum(per_rank) / 2**20,
        )

    def reduce_in_shards(self, model_params, layout=None) -> bool:
        """Take over the reduction of ``model_params``' gradients, if a
        :class:`~fairseq_oss.integration.grad_sync.ShardedGradDataParallel` holds them
        and there is more than one rank; whether it did. ``model_params`` are this
        optimizer's own parameters, or (``layout`` given, as
        :meth:`ShardedAdam.exchange_into` takes it) the model's fp16 parameters of which
        fairseq's ``--fp16`` built them a flat fp32 master copy. Not collective."""
        switch = grad_sync.switch_of(model_params)
        if switch is None or self._optimizer.world_size == 1:
            return False
        # fairseq rebuilds its optimizer when it resumes: the previous one's hooks go, and
        # what its last step left in flight is waited for.
        if switch.reducer is not None:
            switch.reducer.remove_hooks()
        if switch.exchange is not None:
            switch.exchange.wait_all()
        sources = None
        if layout is not None:
            sources = list(model_params)
            self._optimizer.exchange_into(sources, layout)
        unused = switch.unused if layout is None else "zero"  # fairseq's --fp16 zero-fills
        self._reducer = switch.reducer = GradReducer(
            self._optimizer, unused=unused, divide=switch.divide, sync_in_backward=switch,
            sources=sources, layout=layout,
        )
        if self._optimizer.params[0].device.type == "cpu":
            malloc.keep_freed_memory()
        # The wrapper's forward and hooks wait for the parameters (param_reads): the step
        # can return with their exchange in flight, behind the next forward.
        self._optimizer.defer_exchange = True
        switch.exchange = self._optimizer.param_exchange
        return True

    # Same hyperparameters, parsed the same way, as --optimizer adam.
    optimizer_config = FairseqAdam.optimizer_config

    def all_reduce_grads(self, module):
        """With the reduce-scatter, finish it (collective); else fairseq's DDP's own."""
        if self._reducer is None:
            return super().all_reduce_grads(module)
        self._reducer.finish()

    def multiply_grads(self, c):
        shards = self._optimizer.reduced_grads()
        if shards is None:
            return super().multiply_grads(c)
        if shards:  # as FairseqOptimizer.multiply_grads, on this rank's shards
            torch._foreach_mul_(shards, c.to(shards[0].device) if torch.is_tensor(c) else c)

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        """fairseq's clipping; with the reduce-scatter, the norm of the whole gradient
        from every rank's shards (one scalar all-reduce, collective) and the clipping of
        the shards. That norm sums the squares in another order than plain adam's
        per-parameter norms: equal to rounding, and where clipping acts the parameters
        are equal to rounding too (no clipping: coefficient 1, exact)."""
        shards = self._optimizer.reduced_grads()
        if shards is None:
            return super().clip_grad_norm(max_norm, aggregate_norm_fn)
        norm = total_norm(shards, self._optimizer.process_group, self._optimizer.params)
        if max_norm > 0 and shards:
            coef = (float(max_norm) / (norm + 1e-6)).clamp_(max=1)
            torch._foreach_mul_(shards, coef)
        return norm

    def zero_grad(self):
        # Sets every .grad, reads no parameter's values: out of sight of the step's watch
        # (param_reads), which would otherwise see each parameter twice.
        with torch._C.DisableTorchFunction():
            super().zero_grad()
        if self._reducer is not None:
            self._reducer.reset()

    def average_params(self):
        raise NotImplementedError("oss_adam does not support BMUF")

    def state_dict(self):
        """What a save has prepared for this checkpoint (:func:`prepare_state_dict`: the
        placeholders of the state written into the file, the pending state of an
        asynchronous save, or :class:`Unavailable`), once; else the optimizer's own."""
        prepared = _PREPARED.pop(self._optimizer, None)
        return self._optimizer.state_dict() if prepared is None else prepared

    def load_state_dict(self, state_dict, optimizer_overrides=None):
        """A state dict, or the :class:`~fairseq_oss.checkpoint.format.OptimizerStateFile`
        that the load path hands over for a checkpoint file, which every rank reads its
        own slices of (collective, then); ``optimizer_overrides`` as fairseq applies them."""
        if not isinstance(state_dict, OptimizerStateFile):
            return super().load_state_dict(state_dict, optimizer_overrides)
        load_optimizer_state(self._optimizer, state_dict.path, verify=state_dict.verify,
                             shared_fs=state_dict.shared_fs)
        if optimizer_overrides is not None and len(optimizer_overrides) > 0:
            for group in self.param_groups:  # as FairseqOptimizer.load_state_dict does
                group.update(optimizer_overrides)


class Unavailable:
    """What oss_adam's state dict is in a checkpoint requested while an exception is
    being handled (fairseq's ``crash.pt``, possibly on one rank only), where gathering
    the sharded state could hang the other ranks: the file is written without it.

    Not a dict: fairseq's ``utils.move_to_cpu`` rebuilds every dict of the checkpoint as
    a plain one, which would turn this marker into an empty state. It takes the items
    that fairseq's fp16 wrappers add to a state dict (``loss_scale``) and drops them."""

    def __setitem__(self, key, value):
        pass

    def __repr__(self):
        return "<optimizer state not gathered>"
_PREPARED: "weakref.WeakKeyDictionary[ShardedAdam, object]" = weakref.WeakKeyDictionary()


def prepare_state_dict(inner: ShardedAdam, state) -> None:
    """What the next ``state_dict()`` of the oss_adam around ``inner`` returns, once."""
    _PREPARED[inner] = state


def sharded_optimizer(trainer) -> Optional[ShardedAdam]:
    """The trainer's ShardedAdam, or None (without building the optimizer)."""
    opt = getattr(trainer, "_optimizer", None)
    try:
        inner = opt.optimizer if opt is not None else None
    except (NotImplementedError, ValueError, AttributeError):
        return None
    return inner if isinstance(inner, ShardedAdam) else None


def uses_oss_adam(trainer) -> bool:
    """The trainer trains with oss_adam (asked of its config before the optimizer exists)."""
    name = OmegaConf.select(trainer.cfg, "optimizer._name") if OmegaConf.is_config(trainer.cfg) else None
    return name == "oss_adam" or sharded_optimizer(trainer) is not None


def checkpoint_options(trainer) -> dict:
    """The oss_adam flags that the save and load paths follow."""
    opt_cfg = trainer.cfg.optimizer
    return {
        "verify": not bool(getattr(opt_cfg, "oss_skip_checksums", False)),
        "shared_fs": not bool(getattr(opt_cfg, "oss_no_shared_fs", False)),
    }


# fairseq records the optimizer's class name in checkpoints and refuses to resume one
# whose name differs. An oss_adam checkpoint holds FairseqAdam's state in FairseqAdam's
# format, so it says so: stock adam resumes it, and it resumes stock adam's.
FairseqOSSAdam.__name__ = FairseqOSSAdam.__qualname__ = "FairseqAdam"


BUCKET_FLAG = "--oss-bucket-mb"
_TWICE_SHARDED = (
    "--optimizer oss_adam already shards Adam's state across the data-parallel ranks; "
    "--zero-sharding os would shard it a second time. Remove --zero-sharding os "
    "(or use --optimizer adam with --zero-sharding os)."
)
_FSDP = (
    "--ddp-backend fully_sharded (FSDP) already shards the optimizer state, and oss_adam would "
    "shard it again over parameters that FSDP has flattened and split: use --optimizer adam with "
    "--ddp-backend fully_sharded, or oss_adam with another --ddp-backend (pytorch_ddp, the default; "
    "legacy_ddp; no_c10d)."
)


def refusal(cfg) -> Optional[str]:
    """Why oss_adam cannot run fairseq's config ``cfg`` (the whole one: its optimizer,
    distributed training and model settings), in one line; None when it can or when
    ``cfg`` does not ask for oss_adam. Needs no model, data or process group, so the
    launcher asks it before the ranks are spawned."""
    if OmegaConf.select(cfg, "optimizer._name") != "oss_adam":
        return None
    problem = grad_sync.refusal(cfg)
    if problem is not None:
        return problem
    try:
        bucket_size.bucket_bytes(OmegaConf.select(cfg, "optimizer.oss_bucket_mb"), BUCKET_FLAG)
    except ValueError as e:
        return str(e)
    if OmegaConf.select(cfg, "distributed_training.zero_sharding") == "os":
        return _TWICE_SHARDED
    if OmegaConf.select(cfg, "distributed_training.ddp_backend") == "fully_sharded":
        return _FSDP
    return None


def drop_settings_of_oss_adam(cfg) -> None:
    """Remove the ``oss_*`` settings from ``cfg.optimizer`` when it names another optimizer,
    so that switching a Hydra config between oss_adam and adam is changing ``_name`` alone
    (fairseq merges ``cfg.optimizer`` into the named optimizer's dataclass, which refuses
    keys it does not have). Logged; nothing is dropped for oss_adam."""
    node = OmegaConf.select(cfg, "optimizer")
    if not OmegaConf.is_dict(node) or node.get("_name") == "oss_adam":
        return
    dropped = [k for k in node if str(k).startswith("oss_") and k in FairseqOSSAdamConfig.__dataclass_fields__]
    if dropped:
        with open_dict(node):
            for k in dropped:
                del node[k]
        logger.info("optimizer %s: ignoring %s (settings of oss_adam only)", node.get("_name"), ", ".join(dropped))


def _refusing_zero_sharding(fairseq_shard):
    """fairseq's ``optim.shard_`` (``--zero-sharding os``: fairscale's OSS around the
    optimizer), refusing oss_adam: fairscale would build one oss_adam per rank over
    different parameters, and their collectives would not match (gloo aborts, NCCL
    hangs). Called by the trainer as it builds the optimizer, on every rank alike."""

    def shard_(optimizer, group):
        if isinstance(getattr(optimizer, "optimizer", None), ShardedAdam):
            raise ValueError(_TWICE_SHARDED)
        return fairseq_shard(optimizer, group)

    shard_.refuses_oss_adam = True
    return shard_


if not getattr(optim.shard_, "refuses_oss_adam", False):
    optim.shard_ = _refusing_zero_sharding(optim.shard_)

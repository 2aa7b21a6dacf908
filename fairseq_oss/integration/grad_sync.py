"""Which way oss_adam reduces gradients, and the model wrapper that lets it.

Owns ``--oss-grad-reduction`` (what ``auto`` means, what is refused), and, for the
reduce-scatter, the replacement of fairseq's ``DistributedFairseqModel`` (PyTorch's DDP or
fairseq's legacy DDP, which all-reduce every gradient): :class:`ShardedGradDataParallel`
reduces nothing itself. It makes the ranks' parameters equal at the start (as DDP does),
broadcasts buffers when ``--broadcast-buffers`` asks, and its ``no_sync()`` turns the
reduction in backward off for fairseq's ``--update-freq`` micro-batches. oss_adam's
:class:`~fairseq_oss.optim.grad_reduction.GradReducer` does the reduction, driven by the
:class:`SyncSwitch` that the wrapper registers for its parameters. oss_adam's step then
leaves its parameters' exchange in flight, and the wrapper makes every read of a
parameter wait for it (:mod:`fairseq_oss.optim.param_reads`): its forward waits parameter
by parameter, anything else that reads the model waits for all (a deep copy, as fairseq
builds its EMA, or a pickle: for each parameter it copies).
"""
import contextlib
import logging
import weakref
from typing import Dict, Optional

import torch
import torch.distributed as dist
from fairseq.distributed import ModuleProxyWrapper
from fairseq.trainer import Trainer
from omegaconf import OmegaConf, open_dict

from fairseq_oss.integration import patching
from fairseq_oss.integration.patching import ORIGINAL
from fairseq_oss.optim import collectives
from fairseq_oss.optim.param_reads import ReadGuard, install_read_hooks

logger = logging.getLogger(__name__)

MODES = ("auto", "reduce_scatter", "all_reduce")
FLAG = "--oss-grad-reduction"
_DDP_BACKENDS = {"c10d": "mul", "pytorch_ddp": "mul", "legacy_ddp": "div", "no_c10d": "div"}
# The precision modes the reduce-scatter does not run: --bf16 and --memory-efficient-bf16
# (fairseq-train runs them on TPUs only, which oss_adam refuses). Every other mode runs:
# --fp16 with its fp32 master copy sharded (:mod:`fairseq_oss.integration.fp16`);
# --memory-efficient-fp16, whose parameters are the optimizer's, unscaling through
# multiply_grads and checking overflow on the norm; --amp, its GradScaler shown the shards
# (:mod:`fairseq_oss.integration.amp`).
_PRECISION_FLAGS = (("common.bf16", "--bf16"), ("common.memory_efficient_bf16", "--memory-efficient-bf16"))


def _blockers(cfg):
    """What keeps the reduce-scatter from running ``cfg``: flags, in words."""
    out = [flag for key, flag in _PRECISION_FLAGS if OmegaConf.select(cfg, key)]
    fp16_master = OmegaConf.select(cfg, "common.fp16") and not OmegaConf.select(cfg, "common.memory_efficient_fp16")
    if fp16_master and OmegaConf.select(cfg, "optimization.debug_param_names"):
        # on an overflow fairseq reads the master copy's whole fp32 gradient, by name
        out.append("--fp16 with --debug-param-names")
    backend = OmegaConf.select(cfg, "distributed_training.ddp_backend")
    if backend is not None and backend not in _DDP_BACKENDS:
        out.append(f"--ddp-backend {backend}")
    hook = OmegaConf.select(cfg, "distributed_training.ddp_comm_hook")
    if hook not in (None, "none"):
        out.append(f"--ddp-comm-hook {hook}")
    return out


def mode(cfg) -> Optional[str]:
    """``"reduce_scatter"`` or ``"all_reduce"``: what oss_adam does under fairseq's config
    ``cfg`` (the whole one); None when ``cfg`` does not train with oss_adam. ``auto`` is
    the reduce-scatter wherever it runs: fp32, ``--fp16``, ``--memory-efficient-fp16`` or
    ``--amp`` training under pytorch_ddp, legacy_ddp or no_c10d; elsewhere fairseq's
    all-reduce."""
    if OmegaConf.select(cfg, "optimizer._name") != "oss_adam":
        return None
    asked = OmegaConf.select(cfg, "optimizer.oss_grad_reduction") or "auto"
    if asked == "auto":
        return "all_reduce" if _blockers(cfg) else "reduce_scatter"
    return asked


def refusal(cfg) -> Optional[str]:
    """Why ``--oss-grad-reduction`` cannot be what ``cfg`` asks, in one line; else None."""
    asked = OmegaConf.select(cfg, "optimizer.oss_grad_reduction") or "auto"
    if asked not in MODES:
        return f"{FLAG} must be one of {', '.join(MODES)}, got {asked!r}"
    blockers = _blockers(cfg)
    if asked == "reduce_scatter" and blockers:
        return (
            f"{FLAG} reduce_scatter does not run with {', '.join(blockers)} yet: use {FLAG} auto "
            f"(fairseq's all-reduce there), or train in fp32, --fp16, --memory-efficient-fp16 "
            f"or --amp under pytorch_ddp, legacy_ddp or no_c10d"
        )
    return None


class SyncSwitch:
    """What the wrapper and the oss_adam built over the same parameters share: whether
    the backward now running reduces its gradients (False inside ``no_sync``), how
    fairseq's DDP backend would treat them (``unused`` and ``divide`` as
    :class:`~fairseq_oss.optim.grad_reduction.GradReducer` takes them), and that
    optimizer's reducer and parameter exchange."""

    def __init__(self, backend: str):
        self.enabled = True
        self.divide = _DDP_BACKENDS[backend]
        # PyTorch's DDP leaves a parameter no rank used without a gradient; legacy DDP
        # gives every parameter one (zeros).
        self.unused = "skip" if self.divide == "mul" else "zero"
        self.reducer = None  # the GradReducer of the optimizer built last over these parameters
        self.exchange = None  # and its ParamExchange, which its steps leave in flight

    def __call__(self) -> bool:
        return self.enabled


# Each wrapped parameter's switch, by the parameter's id; an entry goes with its parameter
# (tensors compare by value, so they cannot key a dict themselves, and an attribute on the
# parameter would be pickled with it by torch.save, reducer and process group included).
_SWITCHES: Dict[int, SyncSwitch] = {}


def switch_of(params) -> Optional[SyncSwitch]:
    """The switch of the wrapper around ``params`` (any of them), or None when no
    :class:`ShardedGradDataParallel` holds them (fairseq's own wrapper reduces them)."""
    for p in params:
        found = _SWITCHES.get(id(p))
        if found is not None:
            return found
    return None


def wait_for_params(params) -> None:
    """Wait until ``params`` (any of them wrapped by :class:`ShardedGradDataParallel`) hold
    what oss_adam's last step computed: its exchange runs behind the next forward, and a
    read outside the model's modules (fairseq's FP16Optimizer copying the model into its
    master) does not wait by itself."""
    switch = switch_of(params)
    if switch is not None and switch.exchange is not None:
        switch.exchange.wait_all()


class ShardedGradDataParallel(torch.nn.Module):
    """Data parallelism without a gradient all-reduce (oss_adam reduce-scatters them).

    .. warning:: The constructor, and ``forward`` with ``broadcast_buffers``, are
        collective: call them on all ranks of ``process_group``.
    """

    def __init__(self, module, process_group, switch: SyncSwitch, broadcast_buffers: bool = False):
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.switch = switch
        self.broadcast_buffers = broadcast_buffers
        self.reads = ReadGuard(lambda: switch.exchange)
        install_read_hooks(module, self.reads)
        for p in module.parameters():
            if id(p) not in _SWITCHES:
                weakref.finalize(p, _SWITCHES.pop, id(p), None)
            _SWITCHES[id(p)] = switch
        self._broadcast(list(module.parameters()) + list(module.buffers()))

    def _broadcast(self, tensors) -> None:
        """Rank 0's values on every rank, as DDP does at construction."""
        src = collectives.global_rank(self.process_group, 0)
        with torch.no_grad():
            for t in tensors:
                dist.broadcast(t.data, src=src, group=self.process_group)

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers:
            self._broadcast(list(self.module.buffers()))
        return self.reads.forward(self.module, *args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes in this block accumulate gradients locally."""
        old, self.switch.enabled = self.switch.enabled, False
        try:
            yield
        finally:
            self.switch.enabled = old


def _switch(trainer) -> SyncSwitch:
    if getattr(trainer, "_oss_sync_switch", None) is None:
        trainer._oss_sync_switch = SyncSwitch(trainer.cfg.distributed_training.ddp_backend)
    return trainer._oss_sync_switch


def _wrap(trainer, module):
    dt = trainer.cfg.distributed_training
    inner = ShardedGradDataParallel(
        module.to(trainer.device), trainer.data_parallel_process_group, _switch(trainer),
        broadcast_buffers=bool(dt.broadcast_buffers),
    )
    return ModuleProxyWrapper(inner)


def _reduces_in_shards(trainer) -> bool:
    found = mode(trainer.cfg) == "reduce_scatter" and trainer.use_distributed_wrapper
    if found and OmegaConf.select(trainer.cfg, "optimizer.oss_grad_reduction") == "auto":
        with open_dict(trainer.cfg.optimizer):  # what auto became, for the log and the optimizer
            trainer.cfg.optimizer.oss_grad_reduction = "reduce_scatter"
    return found


def _model(self):
    """fairseq's ``Trainer.model``, wrapped by :class:`ShardedGradDataParallel` when
    oss_adam reduce-scatters the gradients."""
    if self._wrapped_model is None and _reduces_in_shards(self):
        self._wrapped_model = _wrap(self, self._model)
        logger.info("oss_adam: gradients reduce-scattered into each rank's shard during backward")
    return ORIGINAL["model"].fget(self)


def _criterion(self):
    """fairseq's ``Trainer.criterion``, likewise (a criterion with parameters)."""
    if self._wrapped_criterion is None and _reduces_in_shards(self):
        from fairseq import utils

        if utils.has_parameters(self._criterion):
            self._wrapped_criterion = _wrap(self, self._criterion)
    return ORIGINAL["criterion"].fget(self)


PATCHES = [
    (Trainer, "model", property(_model)),
    (Trainer, "criterion", property(_criterion)),
]
patching.apply(PATCHES)

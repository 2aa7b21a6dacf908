"""Counting probe for scripts/bench_comm.py, loaded into fairseq-train with --user-dir; it
also registers ``--optimizer zero_adam`` (PyTorch's ZeroRedundancyOptimizer, a contender).

Records on every rank, into $COMM_PROBE_OUT/rank{R}.json at exit, per update:

* ``sent``: bytes this rank sends in the update's collectives, counted where they are
  called, as NCCL's ring algorithms would send them: all-reduce 2(N-1)/N of the tensor,
  reduce-scatter (N-1)/N of the input, all-gather (N-1)/N of the output, broadcast (N-1)/N
  of the tensor (the ring's average per rank), point to point what is sent. PyTorch's DDP
  reduces in C++, so with $COMM_PROBE_COUNT set its buckets go through DDP's default
  Python comm hook, whose ``dist.all_reduce`` is counted (set only for the counting
  runs: the hook is Python, and the timing runs go without it);
* ``grad_bytes``: gradient bytes this rank holds once the reduction is done (the
  parameters' ``.grad``, and oss_adam's reduced shards and staging buffers; not the
  flat bucket buffers that PyTorch's DDP keeps besides ``.grad``, which it does not expose);
* ``peak_rss_mb``: the rank's peak resident memory over the run (``ru_maxrss``);
* ``minor_faults``: the rank's minor page faults in the update (``ru_minflt``): pages
  that the update touched for the first time since the kernel gave them to the process;
* ``seconds``: the update's wall time, and ``after_backward``: from the end of the last
  micro-batch's backward to the end of the optimizer step (gradient reduction left over,
  clipping, the step; for PyTorch's DDP the reduction's tail is inside backward);
  ``after_last_grad``: from the moment the last micro-batch's backward produced its last
  gradient (the last post-accumulate-grad hook of the model's and criterion's parameters)
  to the end of the step: the same span for every contender, DDP's reduction tail and the
  wait for the other ranks' backward included;
  ``param_wait``: time spent in the update waiting for parameters that the previous
  step left in flight (oss_adam under reduce_scatter defers its exchange behind the next
  forward), outside the optimizer step (whose own waits are in ``after_backward``).
"""
import json
import os
import resource
import time

import torch
import torch.distributed as dist
from fairseq.models import distributed_fairseq_model
from fairseq.optim import FairseqOptimizer, register_optimizer
from fairseq.optim.adam import FairseqAdam, FairseqAdamConfig
from fairseq.tasks import FairseqTask
from fairseq.trainer import Trainer

from fairseq_oss import exit_handlers
from fairseq_oss.optim import collectives
from fairseq_oss.optim.param_exchange import ParamExchange

_OUT = os.environ.get("COMM_PROBE_OUT")
RECORD = {"sent": [], "grad_bytes": [], "seconds": [], "after_backward": [], "after_last_grad": [], "param_wait": [],
          "minor_faults": []}
_now = {"sent": 0, "grad_bytes": None, "backward_end": None, "last_grad": None, "param_wait": 0.0, "in_step": False}


def _n(group=None):
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _bytes(t):
    return t.numel() * t.element_size()


def _counting(fn, share):
    def wrapped(*args, **kwargs):
        _now["sent"] += share(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapped


def _group(kwargs):
    return kwargs.get("group")


def _arg(args, kwargs, i, *names):
    """The ``i``-th positional argument, or the first of ``names`` passed by keyword."""
    if len(args) > i:
        return args[i]
    return next(kwargs[n] for n in names if n in kwargs)


def _ring(factor, i, *names):
    def share(*a, **k):
        n = _n(_group(k))
        return factor * (n - 1) * _bytes(_arg(a, k, i, *names)) // n

    return share


_SHARES = {
    "all_reduce": _ring(2, 0, "tensor"),
    "reduce_scatter_tensor": _ring(1, 1, "input"),
    "all_gather_into_tensor": _ring(1, 0, "output_tensor"),
    "all_gather_single": _ring(1, 0, "output_tensor", "output"),
    "broadcast": _ring(1, 0, "tensor"),
    "isend": lambda *a, **k: _bytes(_arg(a, k, 0, "tensor")),
    "send": lambda *a, **k: _bytes(_arg(a, k, 0, "tensor")),
}
for _name, _share in _SHARES.items():
    if hasattr(dist, _name):
        setattr(dist, _name, _counting(getattr(dist, _name), _share))
collectives._all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _counting_allreduce_hook(process_group, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    # default_hooks.allreduce_hook calls dist.all_reduce, which counts it
    return default_hooks.allreduce_hook(process_group, bucket)


def _counting_ddp(build):
    """fairseq's DistributedDataParallel (a function here: fairseq_oss's CPU fixes wrap
    PyTorch's class), with the counting hook registered on what it builds."""

    def ddp(*args, **kwargs):
        model = build(*args, **kwargs)
        model.register_comm_hook(kwargs.get("process_group"), _counting_allreduce_hook)
        return model

    return ddp


if os.environ.get("COMM_PROBE_COUNT"):
    distributed_fairseq_model.DistributedDataParallel = _counting_ddp(distributed_fairseq_model.DistributedDataParallel)

_train_step, _task_step, _optimizer_step = Trainer.train_step, FairseqTask.train_step, FairseqTask.optimizer_step


def _grad_bytes(trainer):
    params = list(trainer.model.parameters()) + list(trainer.criterion.parameters())
    opt = trainer.optimizer
    # --fp16's fp32 master copy (a dict of flat tensors, or a list): its gradient too
    masters = getattr(opt, "fp32_params", None)
    if masters is not None:
        params += list(masters.values()) if isinstance(masters, dict) else list(masters)
    total = sum(_bytes(p.grad) for p in params if p.grad is not None)
    # fairseq's precision wrappers hold oss_adam as fp32_optimizer (--amp) or wrapped_optimizer
    opt = getattr(opt, "fp32_optimizer", None) or getattr(opt, "wrapped_optimizer", None) or opt
    reducer = getattr(opt, "_reducer", None)
    if reducer is not None:
        held = reducer.held_bytes()
        total += held["shards"] + held["staging"]
    return total


def _timed_wait(fn):
    def wrapped(*args, **kwargs):
        if _now["in_step"]:
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _now["param_wait"] += time.perf_counter() - t0

    return wrapped


ParamExchange.wait = _timed_wait(ParamExchange.wait)
ParamExchange.wait_all = _timed_wait(ParamExchange.wait_all)


def _minor_faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def train_step(self, *args, **kwargs):
    _now["sent"], _now["grad_bytes"], _now["param_wait"] = 0, None, 0.0
    t0, faults = time.perf_counter(), _minor_faults()
    out = _train_step(self, *args, **kwargs)
    RECORD["seconds"].append(time.perf_counter() - t0)
    RECORD["minor_faults"].append(_minor_faults() - faults)
    RECORD["sent"].append(_now["sent"])
    RECORD["grad_bytes"].append(_now["grad_bytes"])
    RECORD["param_wait"].append(_now["param_wait"])
    return out


def task_train_step(self, *args, **kwargs):
    out = _task_step(self, *args, **kwargs)
    _now["backward_end"] = time.perf_counter()
    return out


def optimizer_step(self, optimizer, model, update_num):
    trainer_grads = _now.get("trainer")
    if trainer_grads is not None:
        _now["grad_bytes"] = _grad_bytes(trainer_grads)
    _now["in_step"] = True
    try:
        out = _optimizer_step(self, optimizer, model, update_num)
    finally:
        _now["in_step"] = False
    end = time.perf_counter()
    RECORD["after_backward"].append(end - _now["backward_end"])
    RECORD["after_last_grad"].append(end - _now["last_grad"])
    return out


_init = Trainer.__init__


def _grad_arrived(param):
    _now["last_grad"] = time.perf_counter()


def init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    _now["trainer"] = self
    # Registered before any optimizer is built, so that it runs before oss_adam's own hook
    # on the same parameter (which starts that gradient's reduction).
    for p in list(self._model.parameters()) + list(self._criterion.parameters()):
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(_grad_arrived)


@register_optimizer("zero_adam", dataclass=FairseqAdamConfig)
class ZeroAdam(FairseqAdam):
    """PyTorch's ZeroRedundancyOptimizer over torch.optim.Adam, with adam's flags, as a
    contender: fairseq offers no switch for it. Each rank steps its own parameters, then
    each parameter is broadcast from its owner; fairseq's DDP all-reduces the gradients."""

    def __init__(self, cfg, params):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        FairseqOptimizer.__init__(self, cfg)
        self._optimizer = ZeroRedundancyOptimizer(list(params), optimizer_class=torch.optim.Adam,
                                                  **self.optimizer_config)


def dump():
    if not _OUT or not RECORD["seconds"]:
        return
    RECORD["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    rank = dist.get_rank() if dist.is_initialized() else 0
    os.makedirs(_OUT, exist_ok=True)
    with open(os.path.join(_OUT, f"rank{rank}.json"), "w") as f:
        json.dump(RECORD, f)


Trainer.__init__ = init
Trainer.train_step = train_step
FairseqTask.train_step = task_train_step
FairseqTask.optimizer_step = optimizer_step
exit_handlers.register(dump)

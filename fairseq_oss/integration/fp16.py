"""``--fp16`` with oss_adam's reduce-scatter: fairseq's fp32 master copy, sharded.

fairseq's :class:`~fairseq.optim.fp16_optimizer.FP16Optimizer` steps an fp32 master copy
of the model's fp16 parameters (one flat tensor holding them end to end, or with
``--fp16-no-flatten-grads`` one fp32 copy each) with the optimizer it wraps. With stock
adam, fairseq's DDP all-reduces the fp16 gradients, FP16Optimizer copies all of them into
the master's fp32 gradient, and copies the whole master back into the model after the
step. For an oss_adam whose gradients a
:class:`~fairseq_oss.integration.grad_sync.ShardedGradDataParallel` leaves to it:

- ``build_optimizer``: oss_adam reduce-scatters the model's fp16 gradients, in fp16 as
  fairseq's DDP sums them, into its shard of the master's gradient (a
  :class:`~fairseq_oss.optim.grad_reduction.GradReducer` over the fp16 parameters, in the
  master's layout), and its step writes its updated shard of the master into the fp16
  parameters and exchanges those, in fp16
  (:meth:`~fairseq_oss.optim.sharded_adam.ShardedAdam.exchange_into`): as many bytes as
  adam's fp16 all-reduce. The master's full fp32 gradient, which fairseq allocated, is
  let go: a rank holds its shard of it only.
- ``_sync_fp16_grads_to_fp32``: the reduction is finished (a no-op where
  ``all_reduce_grads`` finished it; collective otherwise, and fairseq calls it from
  ``clip_grad_norm`` and ``step``, on every rank).
- ``_sync_fp32_params_to_fp16``: nothing; the step's exchange writes the model.
- ``zero_grad``: the model's gradients and oss_adam's (which resets the reduction), and
  the loss-scale factor as fairseq resets it.

The master copy is then up to date on each rank in that rank's shards only. fairseq reads
it nowhere else: it saves the model's parameters and the optimizer's state, and rebuilds
the master from the model when it loads a checkpoint. Clipping, ``multiply_grads`` and the
overflow check run on oss_adam's shards through fairseq's own code (the norm is the whole
gradient's, from every rank's shards). Anything else (``--bf16``, which fairseq runs on
TPUs only) keeps fairseq's own methods.
"""
from fairseq.optim.fp16_optimizer import FP16Optimizer

from fairseq_oss.integration import grad_sync, patching
from fairseq_oss.integration.optimizer import FairseqOSSAdam
from fairseq_oss.integration.patching import ORIGINAL


def _sharded(fp16) -> "FairseqOSSAdam | None":
    """The oss_adam under ``fp16`` when it reduce-scatters its gradients, else None."""
    inner = getattr(fp16, "fp32_optimizer", None)
    if isinstance(inner, FairseqOSSAdam) and inner._reducer is not None:
        return inner
    return None


def master_layout(fp16_params, fp32_params):
    """The master copies (fairseq's ``fp32_params``: a dict of one flat tensor per device,
    or a list of one tensor per parameter) and, for each, the ``(index in fp16_params,
    numel)`` of the fp16 parameters it holds end to end; as fairseq builds them."""
    if isinstance(fp32_params, dict):
        if len(fp32_params) != 1:
            raise RuntimeError(
                "oss_adam's reduce-scatter under --fp16 needs the master copy on one device; "
                f"fairseq built {len(fp32_params)} (pipeline parallelism): use --oss-grad-reduction all_reduce"
            )
        masters = list(fp32_params.values())
        layout = [[(i, p.numel()) for i, p in enumerate(fp16_params)]]
    else:
        masters = list(fp32_params)
        layout = [[(i, p.numel())] for i, p in enumerate(fp16_params)]
    for m, runs in zip(masters, layout):
        if m.numel() != sum(n for _, n in runs):
            raise RuntimeError("fairseq's fp32 master copy does not hold the fp16 parameters end to end")
    return masters, layout


def build_optimizer(cls, cfg, params, **kwargs):
    params = list(params)
    grad_sync.wait_for_params(params)  # the master copy is built from the model's values
    fp16 = ORIGINAL["fp16_build_optimizer"](cfg, params, **kwargs)
    oss = fp16.fp32_optimizer
    if not isinstance(oss, FairseqOSSAdam) or grad_sync.switch_of(fp16.fp16_params) is None:
        return fp16
    masters, layout = master_layout(fp16.fp16_params, fp16.fp32_params)
    if [id(m) for m in masters] != [id(p) for p in oss._optimizer.params]:
        raise RuntimeError("oss_adam was not built over fairseq's fp32 master copy in its order")
    if oss.reduce_in_shards(fp16.fp16_params, layout):
        for m in masters:
            m.grad = None  # fairseq's full fp32 gradient: oss_adam holds its shard of it
    return fp16


def _sync_fp16_grads_to_fp32(self):
    oss = _sharded(self)
    if oss is None:
        return ORIGINAL["fp16_sync_grads"](self)
    if self._needs_sync:
        oss.all_reduce_grads(None)
        self._needs_sync = False


def _sync_fp32_params_to_fp16(self):
    if _sharded(self) is None:
        return ORIGINAL["fp16_sync_params"](self)


def zero_grad(self):
    oss = _sharded(self)
    if oss is None:
        return ORIGINAL["fp16_zero_grad"](self)
    for p in self.fp16_params:
        p.grad = None
    oss.zero_grad()
    self._needs_sync = False
    if self.scaler is not None:
        self._multiply_factor = 1.0 / float(self.scaler.loss_scale)


PATCHES = [
    (FP16Optimizer, "build_optimizer", classmethod(build_optimizer), "fp16_build_optimizer"),
    (FP16Optimizer, "_sync_fp16_grads_to_fp32", _sync_fp16_grads_to_fp32, "fp16_sync_grads"),
    (FP16Optimizer, "_sync_fp32_params_to_fp16", _sync_fp32_params_to_fp16, "fp16_sync_params"),
    (FP16Optimizer, "zero_grad", zero_grad, "fp16_zero_grad"),
]
patching.apply(PATCHES)

"""``--amp`` with oss_adam: fairseq's AMPOptimizer on oss_adam's state and shards.

fairseq's :class:`~fairseq.optim.amp_optimizer.AMPOptimizer` wraps the fairseq optimizer
but goes around it to the torch optimizer for several calls. For oss_adam this module
routes them through oss_adam, and changes nothing for any other optimizer.

- ``state_dict`` and ``load_state_dict`` (any ``--oss-grad-reduction``): oss_adam's own,
  which hand the save and load paths the state that every rank writes or reads its part
  of (the torch optimizer's own needs a consolidation first, and a save stopped on it).

Under the reduce-scatter the parameters have no ``.grad`` (oss_adam holds each rank's
shard of the summed gradients), while AMPOptimizer hands torch's GradScaler the torch
optimizer, whose parameters' ``.grad`` it unscales and checks for infs, and zeroes and
multiplies ``.grad`` itself. For an oss_adam with a reducer:

- ``zero_grad`` and ``multiply_grads``: oss_adam's own (which reset the reduction, and
  multiply the shards).
- ``clip_grad_norm``: the scaler unscales the shards, then fairseq's own code runs (its
  ``unscale_`` of the torch optimizer finds no ``.grad`` and does nothing).
- ``step``: fairseq calls ``scaler.step`` with the fairseq optimizer, a second object for
  the scaler, which therefore unscales the gradients a second time and skips the step
  where that finds an inf (Adam barely notices the extra factor; this module repeats it, so
  that the numbers are adam's). An inf lands in one rank's shard only, so whether to step
  is agreed by all ranks (one all-reduce of a flag) and the scaler is shown that verdict,
  so that every rank skips, or steps, and moves its scale alike.

Every method here is collective where oss_adam's is (the step, the norm, the verdict).
"""
import torch
import torch.distributed as dist
from fairseq.optim.amp_optimizer import AMPOptimizer

from fairseq_oss.integration import patching
from fairseq_oss.integration.optimizer import FairseqOSSAdam
from fairseq_oss.integration.patching import ORIGINAL


class _Shards:
    """What torch's GradScaler sees of a list of gradient tensors: an optimizer with one
    param group, whose "parameters" alias the tensors (no copy) and have them as ``.grad``.
    ``unscale_`` multiplies them in place and records whether they hold an inf."""

    def __init__(self, grads):
        holders = []
        for g in grads:
            h = g.detach()
            h.grad = g
            holders.append(h)
        self.param_groups = [{"params": holders}]


def _oss(amp) -> "FairseqOSSAdam | None":
    """The oss_adam under ``amp``, else None."""
    inner = getattr(amp, "fp32_optimizer", None)
    return inner if isinstance(inner, FairseqOSSAdam) else None


def _sharded(amp) -> "FairseqOSSAdam | None":
    """The oss_adam under ``amp`` when it reduce-scatters its gradients, else None."""
    oss = _oss(amp)
    return oss if oss is not None and oss._reducer is not None else None


def state_dict(self):
    oss = _oss(self)
    return ORIGINAL["amp_state_dict"](self) if oss is None else oss.state_dict()


def load_state_dict(self, state_dict, optimizer_overrides=None):
    oss = _oss(self)
    if oss is None:
        return ORIGINAL["amp_load_state_dict"](self, state_dict, optimizer_overrides)
    return oss.load_state_dict(state_dict, optimizer_overrides)


def zero_grad(self):
    oss = _sharded(self)
    return ORIGINAL["amp_zero_grad"](self) if oss is None else oss.zero_grad()


def multiply_grads(self, c):
    oss = _sharded(self)
    return ORIGINAL["amp_multiply_grads"](self, c) if oss is None else oss.multiply_grads(c)


def _unscale(amp, grads) -> None:
    """The scaler's ``unscale_`` of ``grads``, in place. The scaler keys what it found by
    the id of the object unscaled: each one is kept alive until ``update()``, so that no
    later one of the same update takes its id."""
    shown = _Shards(grads)
    amp.scaler.unscale_(shown)
    amp.__dict__.setdefault("_oss_unscaled", []).append(shown)


def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
    oss = _sharded(self)
    if oss is not None:
        _unscale(self, oss._optimizer.reduced_grads() or [])
    return ORIGINAL["amp_clip_grad_norm"](self, max_norm, aggregate_norm_fn)


def step(self):
    oss = _sharded(self)
    if oss is None:
        return ORIGINAL["amp_step"](self)
    if not self.scaler.is_enabled():  # as GradScaler.step then: a plain step
        return oss.step()
    inner = oss._optimizer
    shards = inner.reduced_grads() or []
    _unscale(self, shards)  # the second unscale, as fairseq's scaler.step does
    device = inner.params[0].device if inner.params else torch.device("cpu")
    bad = torch.zeros(1, device=device)
    for s in shards:
        if s.numel():
            bad = torch.maximum(bad, (~torch.isfinite(s)).any().float())
    if inner.world_size > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=inner.process_group)
    skip = bool(bad.item())
    # The verdict, as the scaler would have found it on adam's full gradients: an inf in
    # one more "gradient", on every rank or on none; update() then moves every rank's
    # scale alike.
    _unscale(self, [torch.full((1,), float("inf") if skip else 0.0, device=device)])
    if not skip:
        oss.step()
    self.scaler.update()
    self._oss_unscaled.clear()


PATCHES = [
    (AMPOptimizer, name, fn, f"amp_{name}")
    for name, fn in (("state_dict", state_dict), ("load_state_dict", load_state_dict),
                     ("zero_grad", zero_grad), ("multiply_grads", multiply_grads),
                     ("clip_grad_norm", clip_grad_norm), ("step", step))
]
patching.apply(PATCHES)

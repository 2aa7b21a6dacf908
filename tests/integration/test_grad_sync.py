"""oss_adam's wrapper and reducer as fairseq's trainer drives them, in-process at 2 ranks:
``no_sync`` keeps a backward local, ``all_reduce_grads`` finishes the reduction, and an
optimizer built again over the same parameters (fairseq rebuilds it when it resumes)
takes the hooks over from the previous one; fairseq's EMA, built right after a step,
copies that step's parameters."""
from types import SimpleNamespace

import torch

from models import make_model
from ranks import run_ranks


def rebuild_job(rank, world_size):
    from fairseq_oss.integration.grad_sync import ShardedGradDataParallel, SyncSwitch
    from fairseq_oss.integration.optimizer import FairseqOSSAdam

    model = make_model()
    wrapper = ShardedGradDataParallel(model, None, SyncSwitch("pytorch_ddp"))
    params = [p for p in model.parameters() if p.requires_grad]
    cfg = SimpleNamespace(lr=[1e-3], adam_betas="(0.9, 0.999)", adam_eps=1e-8, weight_decay=0.0,
                          oss_bucket_mb=0.0005, fp16_adam_stats=False, tpu=False)
    first, second = FairseqOSSAdam(cfg, params), FairseqOSSAdam(cfg, params)

    def backward():
        idx = torch.arange(rank, rank + 4)
        h = model["fc2"](torch.relu(model["fc1"](model["embed"](idx))))
        model["sometimes"](h).sum().backward()

    out = {}
    with wrapper.no_sync():
        backward()
    out["started_in_no_sync"] = second._reducer._next
    backward()
    out["started"] = second._reducer._next
    second.all_reduce_grads(wrapper)
    out["first_untouched"] = first._reducer._next == 0 and not any(first._reducer._used)
    out["reduced"] = second._optimizer.reduced_grads() is not None
    out["grads_left"] = sum(p.grad is not None for p in params)
    out["buckets"] = len(second._optimizer.partition.buckets)
    return out


def test_no_sync_rebuild_and_all_reduce_grads():
    for r in run_ranks(2, rebuild_job):
        assert r["buckets"] > 1
        assert r["started_in_no_sync"] == 0 and r["started"] > 0
        assert r["first_untouched"] and r["reduced"] and r["grads_left"] == 0


def ema_job(rank, world_size, fixed):
    """``fixed=False`` builds the EMA with torch's own ``Parameter.__deepcopy__``: run by
    hand, its copy holds stale pieces (the check that the test can fail)."""
    import time

    import torch.distributed as dist
    from fairseq import trainer as fairseq_trainer
    from fairseq.dataclass.configs import EMAConfig

    from fairseq_oss.integration.grad_sync import ShardedGradDataParallel, SyncSwitch
    from fairseq_oss.integration.optimizer import FairseqOSSAdam
    from fairseq_oss.optim.param_reads import PARAMETER_DEEPCOPY

    side = dist.new_group(backend="gloo")  # rank 0 steps before the others, who wait on it
    model = make_model()
    wrapper = ShardedGradDataParallel(model, None, SyncSwitch("pytorch_ddp"))
    params = [p for p in model.parameters() if p.requires_grad]
    cfg = SimpleNamespace(lr=[1e-2], adam_betas="(0.9, 0.999)", adam_eps=1e-8, weight_decay=0.0,
                          oss_bucket_mb=0.0005, fp16_adam_stats=False, tpu=False)
    opt = FairseqOSSAdam(cfg, params)
    h = model["fc2"](torch.relu(model["fc1"](model["embed"](torch.arange(rank, rank + 4)))))
    model["sometimes"](h).sum().backward()
    opt.all_reduce_grads(wrapper)
    if rank != 0:
        dist.barrier(group=side)
        time.sleep(0.2)
    opt.step()
    unread = bool(opt._optimizer.param_exchange.unread)
    if rank == 0:
        dist.barrier(group=side)
    # What fairseq's Trainer calls right after the step, the first time (--store-ema).
    deepcopy_when_arrived = torch.nn.Parameter.__deepcopy__  # wrapped by the wrapper's ReadGuard
    assert deepcopy_when_arrived is not PARAMETER_DEEPCOPY
    if not fixed:
        torch.nn.Parameter.__deepcopy__ = PARAMETER_DEEPCOPY
    try:
        ema = fairseq_trainer.build_ema(model, EMAConfig(ema_decay=0.9), None)
    finally:
        torch.nn.Parameter.__deepcopy__ = deepcopy_when_arrived
    copied = {k: v.clone() for k, v in ema.get_model().state_dict().items()}
    current = model.state_dict()  # waits for everything
    dist.destroy_process_group(side)
    return {"unread": unread, "same": all(torch.equal(copied[k], v) for k, v in current.items())}


def test_ema_built_right_after_a_step_copies_the_steps_parameters():
    """fairseq's Trainer builds its EMA (a deep copy of the model) right after the first
    step, while the step's exchange is in flight: the copy waits for it."""
    results = run_ranks(2, ema_job, True)
    assert results[0]["unread"]  # rank 0 copied before the other rank had stepped
    assert all(r["same"] for r in results)

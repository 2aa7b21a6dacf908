"""Measurement probe for scripts/bench.py, loaded into fairseq-train with --user-dir.

Records, on every rank, into $BENCH_PROBE_OUT/rank{R}.json when the process exits:
seconds of each update (and whether an asynchronous save ran in the background during it)
and of its optimizer step, optimizer-state bytes held by this rank, peak resident memory,
and for each checkpoint save and load its wall time and the rise of this process's
resident memory above where it was when the save or load began (sampled every ms). A
save is timed from a clean page cache (``sync`` and a barrier of all ranks before it,
outside the timed window) to this rank's return to training.
Changes nothing in what fairseq computes; builds one throwaway optimizer at start-up
(see below).
"""
import json
import os
import resource
import time

import torch
import torch.distributed as dist
from fairseq import checkpoint_utils
from fairseq.tasks import FairseqTask
from fairseq.trainer import Trainer

from fairseq_oss import exit_handlers
from fairseq_oss.checkpoint import async_save
from fairseq_oss.memory import PeakRss as Peak

_OUT = os.environ.get("BENCH_PROBE_OUT")

# The first optimizer a process builds makes torch import torch._dynamo and much else
# (about 70 MB, once per process). fairseq builds its optimizer inside load_checkpoint
# when it resumes, so that one-time cost would be charged to the resume of every fairseq
# contender, and not to the ZeroRedundancyOptimizer loop, which builds its optimizer
# before it loads. Paid here, at start-up, for all alike.
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
RECORD = {"update_seconds": [], "update_save_in_flight": [], "step_seconds": [], "saves": [], "loads": [], "state_bytes": None}


def state_bytes(trainer):
    inner = trainer.optimizer.optimizer
    if hasattr(inner, "state_bytes"):  # oss_adam
        return inner.state_bytes()
    local = getattr(inner, "optim", inner)  # fairscale OSS keeps its shard's optimizer in .optim
    total = 0
    for entry in local.state.values():
        for v in entry.values():
            if torch.is_tensor(v):
                total += v.numel() * v.element_size()
    return total


_train_step = Trainer.train_step
_optimizer_step = FairseqTask.optimizer_step
_load = Trainer.load_checkpoint
_save = checkpoint_utils.save_checkpoint


def _save_in_flight() -> bool:
    job = async_save.current()
    return job is not None and job.running


def train_step(self, *args, **kwargs):
    in_flight = _save_in_flight()
    t0 = time.perf_counter()
    out = _train_step(self, *args, **kwargs)
    RECORD["update_seconds"].append(time.perf_counter() - t0)
    # did an asynchronous save run in the background during (part of) this update?
    RECORD["update_save_in_flight"].append(in_flight or _save_in_flight())
    if RECORD["state_bytes"] is None:
        RECORD["state_bytes"] = state_bytes(self)
    return out


def optimizer_step(self, *args, **kwargs):
    t0 = time.perf_counter()
    out = _optimizer_step(self, *args, **kwargs)
    RECORD["step_seconds"].append(time.perf_counter() - t0)
    return out


def load_checkpoint(self, *args, **kwargs):
    with Peak() as p:
        out = _load(self, *args, **kwargs)
    if self.get_num_updates() > 0:
        RECORD["loads"].append({"seconds": p.seconds, "rise": p.rise})
    return out


def save_checkpoint(cfg, trainer, *args, **kwargs):
    # From a clean page cache: the previous save's writeback is done (as between real
    # saves minutes apart), and every rank starts the save together.
    os.sync()
    if dist.is_initialized():
        dist.barrier()
    with Peak() as p:
        out = _save(cfg, trainer, *args, **kwargs)
    RECORD["saves"].append({"seconds": p.seconds, "rise": p.rise, "updates": trainer.get_num_updates()})
    return out


def dump():
    if not _OUT or not (RECORD["update_seconds"] or RECORD["loads"]):
        return  # e.g. the launcher process of fairseq's spawn, which trains nothing
    rank = dist.get_rank() if dist.is_initialized() else 0
    RECORD["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    os.makedirs(_OUT, exist_ok=True)
    with open(os.path.join(_OUT, f"rank{rank}.json"), "w") as f:
        json.dump(RECORD, f)


Trainer.train_step = train_step
FairseqTask.optimizer_step = optimizer_step
Trainer.load_checkpoint = load_checkpoint
checkpoint_utils.save_checkpoint = save_checkpoint
exit_handlers.register(dump)

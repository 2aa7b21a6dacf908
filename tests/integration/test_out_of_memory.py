"""End to end, fairseq's recovery when one rank runs out of memory during a training step
(tests/plugins/faults raises fairseq's out-of-memory error on rank 1, in the last
micro-batch of update 3): that rank logs it, clears its gradients (``zero_grad``) and gives
zeros to the update's reduction. fairseq's adam recovers so under ``legacy_ddp``, whose
all-reduce runs after backward; oss_adam must recover there as adam does, bit for bit, or,
where it cannot (backward had already begun the reduce-scatter), stop every rank with the
reason instead of leaving them waiting.
"""
import os

import pytest

from checks import assert_same_training_state, load
from launch import PLUGIN, attempt, ckpt, train_cmd

UPDATES = 4


def _oom_env(tmp_path, where):
    # --update-freq 2: rank 1's 6th micro-batch is the last of update 3, the one that reduces
    return {"FAULT_OOM": where, "FAULT_CRASH_RANK": "1", "FAULT_CRASH_CALL": "6", "FAULT_MARKER_DIR": str(tmp_path)}


def _cmd(data, save_dir, optimizer, *extra):
    return train_cmd(data, save_dir, optimizer, 2, UPDATES, "--user-dir", PLUGIN,
                     "--criterion", "faulty_cross_entropy", *extra)


def _recovered(data, save_dir, env, optimizer, *extra):
    """A run in which rank 1 ran out of memory once and fairseq recovered: its save dir."""
    rc, out = attempt(_cmd(data, save_dir, optimizer, *extra), env=env, timeout=180)
    assert rc == 0, out[-3000:]
    assert "attempting to recover from OOM" in out  # the injected error took fairseq's recovery
    assert load(ckpt(save_dir))["optimizer_history"][-1]["num_updates"] == UPDATES
    return out


@pytest.fixture(scope="module")
def adam_recovered(data, tmp_path_factory):
    """adam under legacy_ddp, where fairseq recovers, per place of the error: its save dir."""
    made = {}

    def make(where):
        if where not in made:
            tmp = tmp_path_factory.mktemp(f"adam-oom-{where}")
            _recovered(data, str(tmp / "run"), _oom_env(tmp, where), "adam", "--ddp-backend", "legacy_ddp")
            made[where] = str(tmp / "run")
        return made[where]

    return make


@pytest.mark.parametrize(
    "where, backend, reduction",
    [("forward", "legacy_ddp", "reduce_scatter"), ("forward", "pytorch_ddp", "reduce_scatter"),
     ("backward", "legacy_ddp", "all_reduce")],
    ids=["in-forward-reduce-scatter-legacy", "in-forward-reduce-scatter-pytorch", "in-backward-all-reduce-legacy"],
)
def test_out_of_memory_on_one_rank_is_recovered_as_adam_recovers(data, tmp_path, adam_recovered, where, backend,
                                                                   reduction):
    """In forward, nothing of the reduce-scatter has begun: the rank that recovers gives
    zeros for every bucket, as legacy DDP all-reduces them (under the default backend too:
    at 2 ranks its * 1/2 and legacy DDP's / 2 are the same bits). In backward, fairseq's own
    all-reduce (--oss-grad-reduction all_reduce) runs after it, as for adam."""
    d = str(tmp_path / "oss_adam")
    out = _recovered(data, d, _oom_env(tmp_path, where), "oss_adam", "--ddp-backend", backend,
                     "--oss-grad-reduction", reduction)
    assert os.path.exists(tmp_path / "fault-injected-on-rank-1")
    reduce_scattered = "gradients reduce-scattered into each rank's shard" in out
    assert reduce_scattered == (reduction == "reduce_scatter")
    assert_same_training_state(ckpt(d), ckpt(adam_recovered(where)))


def test_out_of_memory_in_backward_under_the_reduce_scatter_stops_every_rank_with_the_reason(data, tmp_path):
    """Backward had begun reducing with the other rank when it failed: what was sent cannot
    be taken back, and a rank that went on would restart a reduction its peer is finishing.
    The run ends (no rank hangs), and the log says why and what to change."""
    rc, out = attempt(_cmd(data, str(tmp_path / "run"), "oss_adam"), env=_oom_env(tmp_path, "backward"), timeout=180)
    assert rc != 0 and os.path.exists(tmp_path / "fault-injected-on-rank-1"), out[-3000:]
    assert "gradients reduce-scattered into each rank's shard" in out
    assert "out of memory in the middle of backward is not supported with --oss-grad-reduction reduce_scatter" in out

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


@pytest.mark.parametrize(
    "where, reduction",
    [("forward", "reduce_scatter"), ("backward", "all_reduce")],
    ids=["in-forward-reduce-scatter", "in-backward-all-reduce"],
)
def test_out_of_memory_on_one_rank_is_recovered_as_adam_recovers(data, tmp_path, where, reduction):
    """In forward, nothing of the reduce-scatter has begun: the rank that recovers gives
    zeros for every bucket, as legacy DDP all-reduces them. In backward, fairseq's own
    all-reduce (--oss-grad-reduction all_reduce) runs after it, as for adam."""
    env = _oom_env(tmp_path, where)
    runs = {}
    for optimizer, extra in (("adam", []), ("oss_adam", ["--oss-grad-reduction", reduction])):
        d = str(tmp_path / optimizer)
        rc, out = attempt(_cmd(data, d, optimizer, "--ddp-backend", "legacy_ddp", *extra), env=env, timeout=180)
        assert rc == 0, out[-3000:]
        assert "attempting to recover from OOM" in out  # the injected error took fairseq's recovery
        assert load(ckpt(d))["optimizer_history"][-1]["num_updates"] == UPDATES
        if optimizer == "oss_adam":
            reduce_scattered = "gradients reduce-scattered into each rank's shard" in out
            assert reduce_scattered == (reduction == "reduce_scatter")
        runs[optimizer] = d
    assert os.path.exists(tmp_path / "fault-injected-on-rank-1")
    assert_same_training_state(ckpt(runs["oss_adam"]), ckpt(runs["adam"]))


def test_out_of_memory_in_backward_under_the_reduce_scatter_stops_every_rank_with_the_reason(data, tmp_path):
    """Backward had begun reducing with the other rank when it failed: what was sent cannot
    be taken back, and a rank that went on would restart a reduction its peer is finishing.
    The run ends (no rank hangs), and the log says why and what to change."""
    rc, out = attempt(_cmd(data, str(tmp_path / "run"), "oss_adam"), env=_oom_env(tmp_path, "backward"), timeout=180)
    assert rc != 0 and os.path.exists(tmp_path / "fault-injected-on-rank-1"), out[-3000:]
    assert "gradients reduce-scattered into each rank's shard" in out
    assert "out of memory in the middle of backward is not supported with --oss-grad-reduction reduce_scatter" in out

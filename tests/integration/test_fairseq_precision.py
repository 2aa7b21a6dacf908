"""End to end, fairseq's mixed-precision modes with oss_adam on CPU: ``--fp16`` (one flat
fp32 master tensor, sharded element by element) and ``--memory-efficient-fp16`` (fp16
parameters, fp32 state), against ``--optimizer adam`` in the same mode.

Assumption: fairseq's fp16 training on CPU is deterministic for a given seed, data and
world size (the CPU launch fixes in fairseq_oss/compat.py make the flat path run there),
so equal checkpoints mean equal arithmetic. ``--fp16-init-scale 4096`` makes the first
update overflow on this model: the runs compare a skipped update and a lowered loss scale.
"""
import shutil

import pytest

from checks import assert_same_training_state, load
from launch import CLIPPING, FIRST, RESUMED, attempt, ckpt, train, train_cmd

MODES = {"fp16": ["--fp16"], "memory_efficient_fp16": ["--memory-efficient-fp16"]}
# Clipping acts here: these modes reduce with fairseq's all-reduce (--oss-grad-reduction
# auto), whose gradients are adam's own, bit for bit.
SCALE = ["--fp16-init-scale", "4096", *CLIPPING]


@pytest.fixture(scope="module")
def saved(data, tmp_path_factory):
    """Checkpoints after FIRST updates at 2 ranks, per (mode, optimizer)."""
    root = tmp_path_factory.mktemp("precision")
    out = {}
    for mode, flags in MODES.items():
        for opt in ("adam", "oss_adam"):
            d = out[mode, opt] = str(root / f"{mode}-{opt}")
            out[mode, opt, "log"] = train(data, d, opt, 2, FIRST, extra=[*flags, *SCALE])
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_same_numbers_as_adam(saved, mode):
    """Same parameters, optimizer state, loss scale and skipped updates as adam."""
    got, want = ckpt(saved[mode, "oss_adam"]), ckpt(saved[mode, "adam"])
    assert_same_training_state(got, want)
    state = load(got)["last_optimizer_state"]
    assert state["loss_scale"] == load(want)["last_optimizer_state"]["loss_scale"] < 4096
    assert all(v["exp_avg"].dtype.is_floating_point and v["exp_avg"].element_size() == 4
               for v in state["state"].values())
    if mode == "fp16":  # the flat master copy: one parameter, sharded all the same
        assert len(state["state"]) == 1
    log = saved[mode, "oss_adam", "log"]
    assert "gradient overflow detected" in log and "Adam state sharded over 2 rank(s)" in log
    assert log.count("gradient overflow detected") == saved[mode, "adam", "log"].count("gradient overflow detected")


@pytest.mark.parametrize("mode", list(MODES))
def test_resume_at_another_world_size(data, saved, tmp_path, mode):
    """Saved at 2 ranks, resumed at 3 in the same mode: as adam does."""
    dirs = {}
    for opt in ("adam", "oss_adam"):
        d = dirs[opt] = str(tmp_path / opt)
        shutil.copytree(saved[mode, opt], d)
        log = train(data, d, opt, 3, RESUMED, extra=[*MODES[mode], *SCALE])
        assert f"(epoch 1 @ {FIRST} updates)" in log
    assert load(ckpt(dirs["oss_adam"]))["optimizer_history"][-1]["num_updates"] == RESUMED
    assert_same_training_state(ckpt(dirs["oss_adam"]), ckpt(dirs["adam"]))


def test_min_loss_scale_stops_as_adam_does(data, tmp_path):
    """An overflow that takes the loss scale below --min-loss-scale ends training with
    fairseq's own error, for oss_adam as for adam."""
    for opt in ("adam", "oss_adam"):
        cmd = train_cmd(data, str(tmp_path / opt), opt, 2, FIRST, "--fp16", *SCALE, "--min-loss-scale", "3000")
        rc, out = attempt(cmd, timeout=180)
        assert rc != 0 and "Minimum loss scale reached (3000" in out, (opt, out[-2000:])

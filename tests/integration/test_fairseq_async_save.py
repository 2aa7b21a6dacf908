"""End to end, fairseq-train with --write-checkpoints-asynchronously and oss_adam: what a
background save writes and resumes from, a writer killed or failing in the background,
and fairseq's --keep-* flags, which prune only what the background saves committed.

Assumption: fairseq on CPU is deterministic for a given seed, data and world size, so
equal checkpoints mean the background save wrote what the synchronous one writes.
"""
import os
import subprocess
import sys

import pytest

from checks import assert_same_training_state, load
from launch import ASYNC, ENV, FIRST, PLUGIN, RESUMED, ROOT, attempt, ckpt, train, train_cmd


def test_asynchronous_save_resumes_as_a_synchronous_one(data, trained, resumed_run, tmp_path):
    """--write-checkpoints-asynchronously: training is blocked only for the snapshot; the
    last save, right before training ends, is complete; the checkpoint holds what the
    synchronous save holds, and resuming from it (at 1 rank) continues bit for bit as
    from the synchronous one."""
    d = str(tmp_path / "async")
    log = train(data, d, "oss_adam", 2, FIRST, extra=ASYNC)
    assert "blocked training for" in log and "asynchronous save of" in log
    assert "rank 0 writes the weights" not in log and "written again by rank 0" not in log
    assert_same_training_state(ckpt(d), ckpt(trained("oss_adam", 2)))
    train(data, d, "oss_adam", 1, RESUMED)
    assert_same_training_state(ckpt(d), ckpt(resumed_run("oss_adam", 2, 1)[0]))  # the synchronous save, resumed
    assert not [n for n in os.listdir(d) if n.endswith(".tmp")]


def test_asynchronous_save_killed_mid_write_leaves_the_previous_one(data, tmp_path):
    """Rank 0 is SIGKILLed while its background job writes the 2nd checkpoint: nothing
    appears under that checkpoint's name, checkpoint_last.pt is the 1st (complete), and
    training resumes from it."""
    d = str(tmp_path / "run")
    cmd = train_cmd(data, d, "oss_adam", 2, 6, "--user-dir", PLUGIN, "--save-interval-updates", "2", *ASYNC)
    rc, out = attempt(cmd, env={"FAULT_KILL_SAVE": "2"}, timeout=180)
    assert rc != 0
    assert not os.path.exists(os.path.join(d, "checkpoint_1_4.pt"))
    assert load(ckpt(d))["optimizer_history"][-1]["num_updates"] == 2
    log = train(data, d, "oss_adam", 2, 6, extra=ASYNC)
    assert "(epoch 1 @ 2 updates)" in log
    assert load(ckpt(d))["optimizer_history"][-1]["num_updates"] == 6


def test_asynchronous_save_that_fails_stops_every_rank(data, tmp_path):
    """The 2nd checkpoint's background write fails (disk full): the error is logged, the
    next save stops every rank with it (no hang), nothing appears under the failed
    checkpoint's name, and the 1st checkpoint is intact."""
    d = str(tmp_path / "run")
    cmd = train_cmd(data, d, "oss_adam", 2, 8, "--user-dir", PLUGIN, "--save-interval-updates", "2", *ASYNC)
    rc, out = attempt(cmd, env={"FAULT_FAIL_SAVE": "2"}, timeout=180)
    assert rc != 0
    assert "asynchronous checkpoint save failed on this rank: " in out
    assert "the previous asynchronous checkpoint save failed (rank 0: " in out
    assert "No space left on device (injected)" in out
    assert not os.path.exists(os.path.join(d, "checkpoint_1_4.pt"))
    assert load(ckpt(d))["optimizer_history"][-1]["num_updates"] == 2
    assert not [n for n in os.listdir(d) if n.endswith(".tmp")]


def test_asynchronous_save_that_fails_last_fails_the_run(data, tmp_path):
    """The last checkpoint's background write fails (disk full) as training ends: the run
    waits for it and exits non-zero, saying so; the checkpoint before is intact and
    nothing appears under the failed one's name."""
    d = str(tmp_path / "run")
    cmd = train_cmd(data, d, "oss_adam", 2, 4, "--user-dir", PLUGIN, "--save-interval-updates", "2", *ASYNC)
    rc, out = attempt(cmd, env={"FAULT_FAIL_SAVE": "2"}, timeout=180)
    assert rc != 0
    assert "the last asynchronous checkpoint save failed: " in out, out[-3000:]
    assert "No space left on device (injected)" in out
    assert not os.path.exists(os.path.join(d, "checkpoint_1_4.pt"))
    assert load(ckpt(d))["optimizer_history"][-1]["num_updates"] == 2
    assert not [n for n in os.listdir(d) if n.endswith(".tmp")]


@pytest.fixture(scope="module")
def short_epochs(tmp_path_factory):
    """A corpus of a few updates per epoch at 2 ranks, so that a short run crosses epochs."""
    out = str(tmp_path_factory.mktemp("short-epochs"))
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_corpus.py"), out, "--vocab", "300", "--train-lines", "120", "--valid-lines", "20"],
                   check=True, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return os.path.join(out, "bin")


def test_keep_flags_keep_the_same_files_with_asynchronous_saves(short_epochs, tmp_path):
    """--keep-interval-updates, --keep-last-epochs and --keep-best-checkpoints leave the same
    checkpoints on disk with --write-checkpoints-asynchronously as without it: pruning
    waits for the background save's commit (the newest file counts), and the last save
    prunes too."""
    keep = ["--save-interval-updates", "2", "--keep-interval-updates", "2", "--keep-last-epochs", "1",
            "--max-epoch", "3"]
    listings = {}
    for mode, extra in (("sync", []), ("async", ASYNC)):
        d = str(tmp_path / mode)
        cmd = [c for c in train_cmd(short_epochs, d, "oss_adam", 2, 1000, *keep, *extra)
               if c != "--no-epoch-checkpoints"]
        rc, out = attempt(cmd, timeout=300)
        assert rc == 0, out[-3000:]
        listings[mode] = sorted(n for n in os.listdir(d) if n.endswith(".pt"))
    assert "checkpoint3.pt" in listings["sync"] and "checkpoint2.pt" not in listings["sync"]
    assert len([n for n in listings["sync"] if n.count("_") == 2]) == 2, listings["sync"]
    assert listings["async"] == listings["sync"]

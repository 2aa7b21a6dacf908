"""End to end, what stops a fairseq-train run with oss_adam, and how: a damaged checkpoint,
another model's, one that would run code when loaded, a rank that crashes, a writer killed
in the middle of a save, a save directory rank 0 cannot write to. Every rank stops (none
hangs), the error names the cause, and no checkpoint already written is changed.
"""
import os
import shutil

import pytest
import torch

from checks import load
from launch import ASYNC, FIRST, PLUGIN, RESUMED, attempt, ckpt, digest, train, train_cmd


def _flip_byte(path, record_kind):
    from fairseq_oss.checkpoint.format import CheckpointReader

    reader = CheckpointReader(path)
    optimizer = {r for v in reader.manifest["optimizer_views"].values() for r, _ in v.values()}
    records = [n for n in reader.manifest["records"] if n.startswith("data/")]
    name = next(n for n in records if (n in optimizer) == (record_kind == "optimizer"))
    offset = reader.record_offset(name) + reader.manifest["records"][name]["nbytes"] // 2
    data = bytearray(open(path, "rb").read())
    data[offset] ^= 0x55
    open(path, "wb").write(bytes(data))
    return name


@pytest.mark.parametrize("damage", ["model", "optimizer", "truncated"])
def test_damaged_checkpoint_stops_every_rank(data, trained, tmp_path, damage):
    """A damaged checkpoint_last.pt: every rank exits non-zero (none hangs), the error
    names the file and the first problem, and the file is left as it was."""
    d = str(tmp_path / "run")
    shutil.copytree(trained("oss_adam", 2), d)
    path = ckpt(d)
    if damage == "truncated":
        blob = open(path, "rb").read()
        open(path, "wb").write(blob[: len(blob) // 3])
        expect = "not a readable checkpoint"
    else:
        record = _flip_byte(path, damage)
        expect = f"checksum mismatch in record {record}"
    before = digest(path)
    rc, out = attempt(train_cmd(data, d, "oss_adam", 2, RESUMED), timeout=180)
    assert rc != 0
    assert f"{path}: {expect}" in out or f"{os.path.abspath(path)}: {expect}" in out, out[-3000:]
    assert digest(path) == before


def test_other_model_stops_every_rank(data, trained, tmp_path):
    d = str(tmp_path / "run")
    shutil.copytree(trained("oss_adam", 2), d)
    rc, out = attempt(train_cmd(data, d, "oss_adam", 2, RESUMED, "--decoder-layers", "2"), timeout=180)
    assert rc != 0 and "Cannot load model parameters from checkpoint" in out


@pytest.mark.parametrize("rank, precision", [(0, []), (1, []), (0, ["--fp16"])], ids=["rank0", "rank1", "rank0-fp16"])
def test_crash_on_one_rank_does_not_hang(data, tmp_path, rank, precision):
    """fairseq's crash path (consolidate + crash.pt from an exception handler on the rank
    that failed): it runs no collective, so the run ends instead of hanging; rank 0 writes
    crash.pt with the model and without optimizer state (under --fp16 too, whose wrapper
    adds the loss scale to the state dict it gets). Rank 0's own failure when rank 1
    dies is a RuntimeError, which fairseq re-raises before its crash path: no crash.pt."""
    d = str(tmp_path / "run")
    cmd = train_cmd(data, d, "oss_adam", 2, RESUMED, "--user-dir", PLUGIN, "--criterion", "faulty_cross_entropy",
                    *precision)
    env = {"FAULT_CRASH_RANK": str(rank), "FAULT_CRASH_CALL": "5", "FAULT_MARKER_DIR": str(tmp_path)}
    rc, out = attempt(cmd, env=env, timeout=180)
    # Not the message in the output: which rank's error the launcher reports first is a race.
    assert rc != 0 and os.path.exists(tmp_path / f"fault-injected-on-rank-{rank}"), out[-3000:]
    crash = os.path.join(d, "crash.pt")
    if rank == 0:
        state = torch.load(crash, weights_only=True)
        assert "model" in state and "last_optimizer_state" not in state
    else:
        assert not os.path.exists(crash)


def test_writer_killed_mid_save_leaves_previous_checkpoint(data, tmp_path):
    """Rank 0 is SIGKILLed while streaming its 2nd checkpoint: checkpoint_last.pt is still
    the 1st one, intact (checksums verified on load), and training resumes from it."""
    d = str(tmp_path / "run")
    cmd = train_cmd(data, d, "oss_adam", 2, 6, "--user-dir", PLUGIN, "--save-interval-updates", "2")
    rc, out = attempt(cmd, env={"FAULT_KILL_SAVE": "2"}, timeout=180)
    assert rc != 0
    assert os.path.exists(ckpt(d)), out[-3000:]
    assert load(ckpt(d))["optimizer_history"][-1]["num_updates"] == 2
    assert any(n.endswith(".tmp") for n in os.listdir(d))  # what the killed writer left
    log = train(data, d, "oss_adam", 2, 6)
    assert "(epoch 1 @ 2 updates)" in log
    assert load(ckpt(d))["optimizer_history"][-1]["num_updates"] == 6
    assert not any(n.endswith(".tmp") for n in os.listdir(d))


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("optimizer", ["oss_adam", "adam"])
def test_a_checkpoint_that_would_run_code_is_refused(data, trained, tmp_path, optimizer):
    """A checkpoint crafted to run a shell command when unpickled: resuming from it stops
    every rank with an error naming the type, and the command never runs; with torch's
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (the user trusts the file) it is loaded."""
    d = str(tmp_path / "run")
    shutil.copytree(trained(optimizer, 2), d)
    marker = str(tmp_path / "code-ran")
    state = load(ckpt(d))
    state["extra_state"]["payload"] = _RunsCode(marker)
    os.remove(ckpt(d))
    torch.save(state, ckpt(d))
    rc, out = attempt(train_cmd(data, d, optimizer, 2, RESUMED), timeout=180)
    assert rc != 0 and not os.path.exists(marker)
    assert f"{ckpt(d)}: refused: it holds posix.system" in out and "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1" in out
    rc, out = attempt(train_cmd(data, d, optimizer, 1, FIRST + 1), env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"})
    assert os.path.exists(marker), out[-2000:]


@pytest.mark.parametrize("extra", [[], ASYNC], ids=["sync", "async"])
def test_a_save_directory_rank0_cannot_write_to_stops_every_rank(data, tmp_path, extra):
    """From the 2nd save on, rank 0 cannot create its file in the save directory (EACCES):
    every rank stops with the same error instead of waiting for rank 0, and the 1st
    checkpoint is intact."""
    d = str(tmp_path / "run")
    cmd = train_cmd(data, d, "oss_adam", 2, 6, "--user-dir", PLUGIN, "--save-interval-updates", "2", *extra)
    rc, out = attempt(cmd, env={"FAULT_UNWRITABLE_SAVE": "2"}, timeout=180)
    assert rc != 0
    assert f"rank 0 cannot write a checkpoint in {d}: [Errno 13] Permission denied (injected)" in out, out[-3000:]
    assert not os.path.exists(os.path.join(d, "checkpoint_1_4.pt"))
    assert load(ckpt(d))["optimizer_history"][-1]["num_updates"] == 2
    assert not [n for n in os.listdir(d) if n.endswith(".tmp")]

"""End to end, the checkpoint plugin inside the real fairseq-train: compatibility with
stock fairseq both ways and with fairscale OSS checkpoints, hard-linked aliases, failures
that stop every rank, the crash path, and a writer killed in the middle of a save.

Assumption: fairseq on CPU is deterministic for a given seed, data and world size, so
equal checkpoints mean the optimizer state crossed over exactly.
"""
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from checks import assert_close_training_state, assert_same_training_state, load
from launch import SUM_ORDER_RTOL, ASYNC, COMMON, ENV, FIRST, PLUGIN, RESUMED, ROOT, WITHOUT_HOOK, attempt, ckpt, digest, free_port, train, train_cmd

@pytest.fixture(scope="module")
def saved(trained):
    """Checkpoints after FIRST updates at 2 ranks: oss_adam's and stock adam's."""
    return {opt: trained(opt, 2) for opt in ("oss_adam", "adam")}


def test_every_rank_writes_its_part_of_the_state_and_the_weights(saved):
    """fairseq-train's saves take the parallel path for the Adam state and the model's
    weights: rank 0 neither falls back to writing them alone nor writes the model again
    (which it would log, with why)."""
    log = open(os.path.join(saved["oss_adam"], "train-fairseq-2.log")).read()
    assert "oss_adam: the checkpoint save took" in log
    assert "rank 0 writes the weights" not in log and "written again by rank 0" not in log


def resumed(data, src, tmp, optimizer, world_size, name):
    d = str(tmp / name)
    shutil.copytree(src, d)
    train(data, d, optimizer, world_size, RESUMED)
    return ckpt(d)


def test_stock_adam_resumes_oss_checkpoint_without_the_plugin(data, saved, resumed_run, tmp_path):
    """fairseq-train --optimizer adam, in a process that never imports fairseq_oss,
    resumes an oss_adam checkpoint and continues exactly as from adam's own."""
    d = str(tmp_path / "stock")
    shutil.copytree(saved["oss_adam"], d)
    args = [data, *COMMON, "--optimizer", "adam", "--save-dir", d, "--max-update", str(RESUMED)]
    code = WITHOUT_HOOK.replace("cli_main()", "cli_main(); print('plugin imported:', 'fairseq_oss' in sys.modules)")
    rc, out = attempt([sys.executable, "-c", code, *args])
    assert rc == 0, out[-3000:]
    assert "plugin imported: False" in out and f"(epoch 1 @ {FIRST} updates)" in out
    reference, _ = resumed_run("adam", 2, 1)  # saved["adam"] resumed by adam at 1 rank
    assert_same_training_state(ckpt(d), ckpt(reference))


def test_oss_adam_resumes_stock_adam_checkpoint(data, saved, resumed_run, tmp_path):
    got = resumed(data, saved["adam"], tmp_path, "oss_adam", 3, "oss")
    want = ckpt(resumed_run("adam", 2, 3)[0])  # saved["adam"] resumed by adam at 3 ranks
    assert load(got)["optimizer_history"][-1]["num_updates"] == RESUMED
    assert_close_training_state(got, want, SUM_ORDER_RTOL)  # 3 ranks: the sum's order


def test_resume_without_a_shared_file_system(data, saved, resumed_run, tmp_path):
    """--oss-no-shared-fs: rank 0 reads the file and sends each rank its slices."""
    got = ckpt(resumed_run("oss_adam", 2, 3)[0])  # saved["oss_adam"] resumed at 3 ranks
    d = str(tmp_path / "no-shared-fs")
    shutil.copytree(saved["oss_adam"], d)
    train(data, d, "oss_adam", 3, RESUMED, extra=["--oss-no-shared-fs"])
    assert_same_training_state(ckpt(d), got)


def test_oss_adam_resumes_fairscale_oss_checkpoint(data, tmp_path):
    """A checkpoint of fairseq's --zero-sharding os (fairscale OSS) resumes with oss_adam
    at another world size, as stock adam resumes it."""
    pytest.importorskip("fairscale")
    src = str(tmp_path / "fairscale")
    train(data, src, "adam", 2, FIRST, extra=["--zero-sharding", "os", "--ddp-backend", "legacy_ddp"])
    got = resumed(data, src, tmp_path, "oss_adam", 3, "oss")
    want = resumed(data, src, tmp_path, "adam", 3, "adam")
    assert_close_training_state(got, want, SUM_ORDER_RTOL)  # 3 ranks: the sum's order


def test_aliases_are_independent_files_and_old_checkpoints_are_deleted(data, tmp_path):
    d = str(tmp_path / "run")
    train(data, d, "oss_adam", 2, 6, extra=["--save-interval-updates", "2", "--keep-interval-updates", "1"])
    names = sorted(os.listdir(d))
    assert [n for n in names if n.endswith(".pt")] == ["checkpoint_1_6.pt", "checkpoint_last.pt"]
    assert not [n for n in names if n.endswith(".tmp")]
    assert os.stat(os.path.join(d, "checkpoint_1_6.pt")).st_ino != os.stat(ckpt(d)).st_ino
    assert digest(os.path.join(d, "checkpoint_1_6.pt")) == digest(ckpt(d))
    assert load(ckpt(d))["optimizer_history"][-1]["num_updates"] == 6


def test_writing_one_name_never_changes_another_checkpoint(data, tmp_path):
    """An oss_adam save directory, then what users do in it: resume with --optimizer adam
    (fairseq copies checkpoint_last.pt over itself), resume with --no-save-optimizer-state,
    and write a checkpoint in place as fairseq's scripts/average_checkpoints.py --output
    does (torch.save to an existing name). The numbered checkpoints never change."""
    d = str(tmp_path / "run")
    train(data, d, "oss_adam", 2, 4, extra=["--save-interval-updates", "2"])
    numbered = [os.path.join(d, n) for n in ("checkpoint_1_2.pt", "checkpoint_1_4.pt")]
    before = [digest(p) for p in numbered]
    train(data, d, "adam", 2, 6, extra=["--save-interval-updates", "2"])
    train(data, d, "oss_adam", 2, 8, extra=["--save-interval-updates", "2", "--no-save-optimizer-state"])
    assert [digest(p) for p in numbered] == before
    assert load(ckpt(d))["optimizer_history"][-1]["num_updates"] == 8
    torch.save({"averaged": torch.zeros(3)}, ckpt(d))
    torch.save({"averaged": torch.ones(3)}, os.path.join(d, "checkpoint_1_8.pt"))
    assert [digest(p) for p in numbered] == before
    assert load(os.path.join(d, "checkpoint_1_6.pt"))["optimizer_history"][-1]["num_updates"] == 6


def test_two_runs_share_a_save_directory(data, tmp_path):
    """Two runs at once in one directory (--checkpoint-suffix _a / _b), saving at every
    update: neither removes the other's temporaries, both finish with their checkpoints."""
    d = str(tmp_path / "shared")
    procs = [
        subprocess.Popen(train_cmd(data, d, "oss_adam", 1, 8, "--save-interval-updates", "1",
                                   "--checkpoint-suffix", sfx, "--seed", str(seed)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
        for sfx, seed in (("_a", 1), ("_b", 2))
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[-2000:] for o in outs]
    for sfx in ("_a", "_b"):
        assert load(os.path.join(d, f"checkpoint_last{sfx}.pt"))["optimizer_history"][-1]["num_updates"] == 8
    assert not [n for n in os.listdir(d) if n.endswith(".tmp")]


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
def test_damaged_checkpoint_stops_every_rank(data, saved, tmp_path, damage):
    """A damaged checkpoint_last.pt: every rank exits non-zero (none hangs), the error
    names the file and the first problem, and the file is left as it was."""
    d = str(tmp_path / "run")
    shutil.copytree(saved["oss_adam"], d)
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


def test_other_model_stops_every_rank(data, saved, tmp_path):
    d = str(tmp_path / "run")
    shutil.copytree(saved["oss_adam"], d)
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


def launch_per_rank(data, save_dirs, optimizer, max_update, *extra, timeout=240):
    """One fairseq-train process per rank, each with its own --save-dir: ranks on nodes
    that do not share a file system (or see different files under one name). Returns
    (exit codes, rank 0's output)."""
    port = free_port()
    procs = []
    for rank, d in enumerate(save_dirs):
        cmd = train_cmd(data, d, optimizer, 1, max_update, *extra) + [
            "--distributed-world-size", str(len(save_dirs)), "--distributed-rank", str(rank),
            "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-no-spawn"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV))
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [p.returncode for p in procs], outs[0]


@pytest.fixture(scope="module")
def three_ranks(data, tmp_path_factory):
    """A save directory at FIRST updates (3 ranks) that also holds an older checkpoint,
    and where a resume from it on a shared file system ends (the reference)."""
    root = tmp_path_factory.mktemp("three-ranks")
    src, reference = str(root / "src"), str(root / "reference")
    train(data, src, "oss_adam", 3, FIRST, extra=["--save-interval-updates", "2"])
    shutil.copytree(src, reference)
    train(data, reference, "oss_adam", 3, RESUMED)
    return src, reference


@pytest.mark.parametrize("other_ranks_see", ["nothing", "an older file"])
def test_ranks_that_see_another_file_get_rank0s(data, three_ranks, tmp_path, other_ranks_see):
    """Ranks 1 and 2 do not see rank 0's checkpoint_last.pt (no shared file system), or
    see an older one under the same name: they get the model and their optimizer slices
    from rank 0 (logged), never from their own file, and the run continues exactly as a
    resume on a shared file system does."""
    src, reference = three_ranks
    dirs = [str(tmp_path / f"node{r}") for r in range(3)]
    shutil.copytree(src, dirs[0])
    for d in dirs[1:]:
        os.makedirs(d)
        if other_ranks_see == "an older file":
            shutil.copyfile(os.path.join(src, "checkpoint_1_2.pt"), ckpt(d))
    codes, out = launch_per_rank(data, dirs, "oss_adam", RESUMED)
    assert codes == [0, 0, 0], out[-3000:]
    what = "sees no file" if other_ranks_see == "nothing" else "sees another file"
    assert f"rank 1 on {socket.gethostname()} {what}" in out and "rank 0 reads it and sends" in out
    assert f"(epoch 1 @ {FIRST} updates)" in out
    assert_same_training_state(ckpt(dirs[0]), ckpt(reference))


def test_a_checkpoint_rank0_does_not_see_stops_every_rank(data, saved, tmp_path):
    """Rank 0 sees no checkpoint, rank 1 does: neither starts afresh nor hangs; both stop
    with an error that names the node and the file."""
    dirs = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    os.makedirs(dirs[0])
    shutil.copytree(saved["oss_adam"], dirs[1])
    codes, out = launch_per_rank(data, dirs, "oss_adam", RESUMED)
    assert codes[0] != 0 and codes[1] != 0
    assert f"{ckpt(dirs[0])}: rank 0 on {socket.gethostname()} sees no checkpoint there, but rank 1 on" in out
    assert not os.path.exists(ckpt(dirs[0]))


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("optimizer", ["oss_adam", "adam"])
def test_a_checkpoint_that_would_run_code_is_refused(data, saved, tmp_path, optimizer):
    """A checkpoint crafted to run a shell command when unpickled: resuming from it stops
    every rank with an error naming the type, and the command never runs; with torch's
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (the user trusts the file) it is loaded."""
    d = str(tmp_path / "run")
    shutil.copytree(saved[optimizer], d)
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


def test_asynchronous_save_resumes_as_a_synchronous_one(data, saved, tmp_path):
    """--write-checkpoints-asynchronously: training is blocked only for the snapshot; the
    last save, right before training ends, is complete; the checkpoint holds what the
    synchronous save holds, and resuming from it continues bit for bit the same."""
    d = str(tmp_path / "async")
    log = train(data, d, "oss_adam", 2, FIRST, extra=ASYNC)
    assert "blocked training for" in log and "asynchronous save of" in log
    assert "rank 0 writes the weights" not in log and "written again by rank 0" not in log
    assert_same_training_state(ckpt(d), ckpt(saved["oss_adam"]))
    sync = str(tmp_path / "sync")
    shutil.copytree(saved["oss_adam"], sync)
    for directory in (d, sync):
        train(data, directory, "oss_adam", 2, RESUMED)
    assert_same_training_state(ckpt(d), ckpt(sync))
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

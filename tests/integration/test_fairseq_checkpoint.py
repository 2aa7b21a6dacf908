"""End to end, the checkpoint plugin inside the real fairseq-train: every rank writes its
part, compatibility with stock fairseq both ways and with fairscale OSS checkpoints,
resumes where ranks do not share a file system, hard-linked aliases and other names never
changed. (What stops a run: test_fairseq_checkpoint_failures.py; background saves:
test_fairseq_async_save.py.)

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
from launch import (ASYNC, SUM_ORDER_RTOL, COMMON, ENV, FIRST, RESUMED, ROOT, WITHOUT_HOOK, attempt, ckpt, digest,
                    free_port, train, train_cmd)


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


RANK_BUFFERS = ["--user-dir", os.path.join(ROOT, "tests", "plugins", "rank_buffers"), "--arch", "lm_rank_buffers"]
EMA = ["--store-ema", "--ema-fp32", "--ema-decay", "0.9", "--ema-start-update", "0"]


@pytest.mark.parametrize("world_size,precision", [(2, ["--fp16"]), (3, [])])
def test_buffers_that_differ_between_ranks_are_saved_from_rank_0(data, tmp_path, world_size, precision):
    """A buffer that each rank sets from its own state (tests/plugins/rank_buffers: its rank's
    number plus one, as BatchNorm's running statistics come from each rank's own batches) is
    saved with rank 0's values, as fairseq saves it, by oss_adam too: in the model, in the
    EMA model and in its float32 copies (--ema-fp32; with --fp16 their own storages, else
    the EMA's own tensors), in an asynchronous save. The parameters are still written by
    every rank. At 2 ranks the whole checkpoint is adam's, bit for bit; at 3, the buffers
    are (they depend on no parameter)."""
    dirs = {}
    for opt, more in (("adam", []), ("oss_adam", ASYNC)):
        dirs[opt] = str(tmp_path / opt)
        log = train(data, dirs[opt], opt, world_size, FIRST, extra=RANK_BUFFERS + EMA + precision + more)
    assert "written again by rank 0" not in log and "rank 0 writes the weights" not in log
    got, want = (load(ckpt(dirs[opt])) for opt in ("oss_adam", "adam"))
    name = "stats.rank"
    for where in (("model",), ("extra_state", "ema"), ("extra_state", "ema_fp32_params")):
        g, w = got, want
        for key in where:
            g, w = g[key], w[key]
        assert torch.equal(g[name], w[name]), where
        # rank 0's ones (the EMA, a deep copy of the model after the first step, averages ones)
        assert torch.equal(w[name], torch.ones_like(w[name])), where
    if world_size == 2:
        assert_same_training_state(ckpt(dirs["oss_adam"]), ckpt(dirs["adam"]))


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
    # Batches made on the training thread (no batch thread: without this package's stop of
    # it, fairseq can abort as it exits, fairseq_oss/integration/data_threads.py); the same batches.
    args = [data, *COMMON, "--optimizer", "adam", "--save-dir", d, "--max-update", str(RESUMED), "--data-buffer-size", "0"]
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



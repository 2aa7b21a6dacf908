"""End to end: the real ``fairseq-train`` and ``fairseq-hydra-train`` on a tiny generated
corpus, on CPU with gloo, ``--optimizer oss_adam`` against ``--optimizer adam``.

Assumption: with the same seed, data and world size, fairseq's training is deterministic
on CPU, so any difference in the checkpoints comes from the optimizer. Checkpoints are
compared bit for bit (tests/checks.py).
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from fairseq_oss.checkpoint.index import CheckpointIndex
from fairseq_oss.integration import rank_start

from checks import assert_close_training_state, assert_same_training_state, load
from launch import (ASYNC, BIN, CLIPPING, COMMON, DEFAULT_WORKERS, ENV, FIRST, RESUMED, ROOT, SUM_ORDER_RTOL, WITHOUT_HOOK, attempt,
                    ckpt, run, tool, train, train_cmd)


def assert_matches_adam(got, want, world_size):
    """Bit for bit at 1 and 2 ranks (a sum of two values does not depend on its order);
    at 3, to the rounding of the sum's order (launch.SUM_ORDER_RTOL)."""
    if world_size <= 2:
        assert_same_training_state(got, want)
    else:
        assert_close_training_state(got, want, SUM_ORDER_RTOL)

@pytest.fixture(scope="module")
def base(trained):
    """Checkpoints after FIRST updates, per (optimizer, world size), launched by fairseq-train."""
    return {(opt, ws): trained(opt, ws) for ws in (1, 2, 3) for opt in ("adam", "oss_adam")}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_parity_with_adam(base, world_size):
    """oss_adam at N ranks, its gradients reduce-scattered (the default), writes the same
    model and the same optimizer state, in the same format, as --optimizer adam at N ranks:
    bit for bit at 1 and 2, to the rounding of the sum's order at 3."""
    assert_matches_adam(ckpt(base["oss_adam", world_size]), ckpt(base["adam", world_size]), world_size)
    assert load(ckpt(base["oss_adam", world_size]))["optimizer_history"][-1]["num_updates"] == FIRST
    with open(os.path.join(base["oss_adam", world_size], f"train-fairseq-{world_size}.log")) as f:
        log = f.read()
    assert f"Adam state sharded over {world_size} rank(s)" in log
    assert (f"starting {world_size} ranks ({rank_start.START_METHOD})" in log) == (world_size > 1)
    assert ("gradients reduce-scattered into each rank's shard" in log) == (world_size > 1)
    kept = ("glibc's malloc settings unchanged: GLIBC_TUNABLES" if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")
            else "glibc's malloc keeps the memory an update frees for the next one")  # test_malloc.py
    assert (kept in log) == (world_size > 1)


def test_at_4_ranks_close_to_adam_and_the_same_bits_run_to_run(data, tmp_path):
    """At 4 ranks the sum's order differs from fairseq's all-reduce (launch.SUM_ORDER_RTOL),
    but oss_adam's own order is fixed: a second run gives the same checkpoint, bit for bit."""
    dirs = {}
    for name, opt in (("adam", "adam"), ("oss_adam", "oss_adam"), ("oss_adam again", "oss_adam")):
        dirs[name] = str(tmp_path / name.replace(" ", "_"))
        train(data, dirs[name], opt, 4, FIRST)
    assert_close_training_state(ckpt(dirs["oss_adam"]), ckpt(dirs["adam"]), SUM_ORDER_RTOL)
    assert_same_training_state(ckpt(dirs["oss_adam again"]), ckpt(dirs["oss_adam"]))


def gnorms(log):
    return re.findall(r"gnorm=([\d.]+)", log)


def test_clipping_that_acts_and_update_freq_3(data, base, tmp_path):
    """--clip-norm acting on every update, --update-freq 3, at 2 ranks: the reduce-scatter
    logs adam's gnorm and reaches adam's parameters to rounding (its norm sums squares
    in another order); --oss-grad-reduction all_reduce (fairseq's DDP) gives adam's bits."""
    extra = [*CLIPPING, "--update-freq", "3"]
    logs, dirs = {}, {}
    for name, opt, flags in (("adam", "adam", []), ("rs", "oss_adam", []),
                             ("ar", "oss_adam", ["--oss-grad-reduction", "all_reduce"])):
        dirs[name] = str(tmp_path / name)
        logs[name] = train(data, dirs[name], opt, 2, FIRST, extra=[*extra, *flags])
    assert "gradients reduce-scattered" in logs["rs"] and "gradients reduce-scattered" not in logs["ar"]
    assert gnorms(logs["rs"]) == gnorms(logs["adam"]) and len(gnorms(logs["adam"])) == FIRST
    assert all(float(g) > 0.5 for g in gnorms(logs["adam"]))  # clipping acted on every update
    assert_same_training_state(ckpt(dirs["ar"]), ckpt(dirs["adam"]))
    assert_close_training_state(ckpt(dirs["rs"]), ckpt(dirs["adam"]), SUM_ORDER_RTOL)


def test_ema_and_validation_right_after_steps_equal_adams(data, tmp_path):
    """At 2 ranks, what reads the parameters right after a step, while oss_adam's exchange
    of them is still in flight (it runs behind the next forward): fairseq's EMA (built as a
    deep copy of the model after the first step, then updated after each one; its float32
    copies too, --ema-fp32) and validation every 2 updates. Both see adam's bits: the EMA in
    the checkpoint, saved synchronously and asynchronously, the validation losses in the log.
    The EMA's tensors are written as the model's are, by every rank (records that precede
    the pickle in the file: rank 0's pickling writes its own tensors after it)."""
    extra = ["--store-ema", "--ema-fp32", "--ema-decay", "0.9", "--ema-start-update", "0",
             "--validate-interval-updates", "2"]
    common = [c for c in COMMON if c != "--disable-validation"]
    dirs, logs = {}, {}
    for run_name, opt, more in (("adam", "adam", []), ("oss_adam", "oss_adam", []), ("async", "oss_adam", ASYNC)):
        dirs[run_name] = str(tmp_path / run_name)
        os.makedirs(dirs[run_name])
        logs[run_name] = run([os.path.join(BIN, "fairseq-train"), data, *common, "--optimizer", opt, "--save-dir",
                              dirs[run_name], "--max-update", str(FIRST), "--distributed-world-size", "2", *extra,
                              *more], os.path.join(dirs[run_name], "train.log"))
    want = load(ckpt(dirs["adam"]))["extra_state"]
    assert len(want["ema"]) > 0 and want["ema_fp32_params"].keys() == want["ema"].keys()
    # The EMA moved away from the model: it averaged the steps it was given.
    model = load(ckpt(dirs["adam"]))["model"]
    assert any(not torch.equal(model[name], t) for name, t in want["ema"].items() if t.is_floating_point())
    valid = {name: re.findall(r"valid on 'valid' subset \| loss ([\d.]+)", log) for name, log in logs.items()}
    assert len(valid["adam"]) >= FIRST // 2
    for run_name in ("oss_adam", "async"):
        assert "gradients reduce-scattered" in logs[run_name]
        assert "written again by rank 0" not in logs[run_name]
        assert valid[run_name] == valid["adam"]
        assert_same_training_state(ckpt(dirs[run_name]), ckpt(dirs["adam"]))
        got = load(ckpt(dirs[run_name]))["extra_state"]
        for part in ("ema", "ema_fp32_params"):
            assert got[part].keys() == want[part].keys()
            for name, t in want[part].items():
                assert torch.equal(got[part][name], t), (part, name)
        index = CheckpointIndex(ckpt(dirs[run_name]))
        pickle_at = index.reader.record_offset("data.pkl")
        for part in ("ema", "ema_fp32_params"):
            records = index.records_of(index.obj["extra_state"][part])
            assert records and all(r.offset < pickle_at for r in records.values()), part


CRITERION_PARAMS = ["--user-dir", os.path.join(ROOT, "tests", "plugins", "criterion_params"),
                    "--criterion", "scaled_cross_entropy"]


@pytest.mark.parametrize("update_freq", ["2", "1"])
def test_a_criterion_with_parameters_trains_as_with_adam(data, tmp_path, update_freq):
    """A criterion with parameters of its own (tests/plugins/criterion_params): fairseq wraps
    it for data-parallel training beside the model, and oss_adam reduce-scatters its
    gradients with the model's, once per update, and its weights are written into the
    checkpoint by every rank as the model's are. At 2 ranks the checkpoint, the criterion's
    entry included, is adam's bit for bit. With --update-freq 2 the reference is adam under
    legacy_ddp: under the default pytorch_ddp, fairseq's own DDP of the criterion (outside
    its no_sync) all-reduces the criterion's gradients after every micro-batch, which sums
    them in another order (the last bits differ); so would oss_adam if fairseq's wrapper
    were left around the criterion."""
    dirs = {}
    reference = ["--ddp-backend", "legacy_ddp"] if update_freq == "2" else []
    for opt, more in (("adam", reference), ("oss_adam", [])):
        dirs[opt] = str(tmp_path / opt)
        log = train(data, dirs[opt], opt, 2, FIRST, extra=CRITERION_PARAMS + ["--update-freq", update_freq] + more)
    assert "gradients reduce-scattered" in log
    got, want = (load(ckpt(dirs[opt]))["criterion"] for opt in ("oss_adam", "adam"))
    assert set(want) == {"scale", "bias"} and not torch.equal(want["scale"], torch.ones(1))  # it trained
    assert_same_training_state(ckpt(dirs["oss_adam"]), ckpt(dirs["adam"]))
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    # written by every rank as the model's weights are: records that precede the pickle
    index = CheckpointIndex(ckpt(dirs["oss_adam"]))
    records = index.records_of(index.obj["criterion"])
    assert records and all(r.offset < index.reader.record_offset("data.pkl") for r in records.values())


READS_PLUGIN = os.path.join(ROOT, "tests", "plugins", "reads")


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_p_data_read_right_after_each_step_is_what_the_step_computed(data, base, tmp_path, world_size):
    """A user's task reads every parameter through ``p.data`` right after fairseq's
    optimizer step, on every rank, while oss_adam's exchange of them is in flight (it runs
    behind the next forward): each read equals what has arrived once the exchange is
    waited for, and the run trains as one without the reads does."""
    d, out = str(tmp_path / "run"), str(tmp_path / "reads")
    os.makedirs(out)
    cmd = train_cmd(data, d, "oss_adam", world_size, FIRST, "--user-dir", READS_PLUGIN, "--task", "lm_reads_after_step")
    rc, log = attempt(cmd, env={"READS_OUT": out}, timeout=300)
    assert rc == 0, log[-3000:]
    for rank in range(world_size):
        with open(os.path.join(out, f"rank{rank}.jsonl")) as f:
            records = [json.loads(line) for line in f]
        assert [r["update"] for r in records] == list(range(FIRST)), rank
        assert all(r["same"] for r in records), (rank, records)
        # Every read met the exchange in flight (nothing to exchange at one rank).
        assert all(r["in_flight"] == (world_size > 1) for r in records), (rank, records)
    assert_same_training_state(ckpt(d), ckpt(base[("oss_adam", world_size)]))


def test_checkpoint_is_plain_adam_format_and_size(base):
    """No tensor stored twice, one param_groups list: the file is as big as adam's."""
    for ws in (1, 2, 3):
        a, b = ckpt(base["adam", ws]), ckpt(base["oss_adam", ws])
        assert abs(os.path.getsize(a) - os.path.getsize(b)) <= 0.005 * os.path.getsize(a)
        sd = load(b)["last_optimizer_state"]
        assert set(sd) == {"state", "param_groups"} and len(sd["param_groups"]) == 1


@pytest.mark.parametrize("save_ws, load_ws", [(2, 1), (2, 3), (1, 2), (3, 2)])
def test_resume_at_another_world_size(resumed_run, save_ws, load_ws):
    """A checkpoint saved at N resumes at M, and continues exactly as adam saved at N and
    resumed at M does."""
    dirs = {}
    for opt in ("adam", "oss_adam"):
        d, log = resumed_run(opt, save_ws, load_ws)
        dirs[opt] = d
        assert f"Loaded checkpoint {ckpt(d)} (epoch 1 @ {FIRST} updates)" in log
    assert load(ckpt(dirs["oss_adam"]))["optimizer_history"][-1]["num_updates"] == RESUMED
    assert_matches_adam(ckpt(dirs["oss_adam"]), ckpt(dirs["adam"]), max(save_ws, load_ws))


@pytest.mark.parametrize(
    "launch, ddp_backend",
    [("torchrun", "pytorch_ddp"), ("torchrun", "legacy_ddp"), ("no-spawn", "pytorch_ddp"),
     ("no-spawn", "legacy_ddp"), ("spawned", "legacy_ddp")],
)
def test_launch_styles(data, base, tmp_path, launch, ddp_backend):
    """Every launcher and both DDP backends train on CPU and reach the same parameters
    as fairseq-train's own launch (its ranks forked) with the default backend (tested in
    test_parity_with_adam), with fairseq's default loader process per rank (the base runs
    load in process). "spawned": fairseq-train's launch with the ranks spawned, as where
    fork is not safe (fairseq_oss/integration/rank_start.py)."""
    d = str(tmp_path / "run")
    log = train(data, d, "oss_adam", 2, FIRST, launch=launch, extra=["--ddp-backend", ddp_backend, *DEFAULT_WORKERS])
    assert "Adam state sharded over 2 rank(s)" in log
    assert ("starting 2 ranks (spawn)" in log) == (launch == "spawned")
    assert_same_training_state(ckpt(d), ckpt(base["oss_adam", 2]))


def test_hydra_config_matches_adam(data, tmp_path):
    """configs/lm_tiny.yaml runs with fairseq-hydra-train, with the overrides users write,
    and gives the same bits as the same config with optimizer=adam, or with
    optimizer._name=adam (one word switches both ways)."""
    dirs = {}
    for opt, override in (("oss_adam", "optimizer=oss_adam"), ("adam", "optimizer=adam"),
                          ("adam_by_name", "optimizer._name=adam")):
        d = dirs[opt] = str(tmp_path / opt)
        run([os.path.join(BIN, "fairseq-hydra-train"), "--config-dir", os.path.join(ROOT, "configs"),
             "--config-name", "lm_tiny", f"task.data={data}", override,
             "optimizer.adam_betas=(0.9,0.98)", "optimization.max_update=4",
             "lr_scheduler.warmup_updates=2", f"checkpoint.save_dir={d}", f"hydra.run.dir={d}/hydra",
             "dataset.disable_validation=true", "dataset.num_workers=0"], os.path.join(str(tmp_path), f"{opt}.log"))
    cfg = load(ckpt(dirs["oss_adam"]))["cfg"]
    assert cfg["optimizer"]["_name"] == "oss_adam" and cfg["optimizer"]["adam_betas"] == "(0.9,0.98)"
    assert cfg["distributed_training"]["distributed_world_size"] == 2
    assert_same_training_state(ckpt(dirs["oss_adam"]), ckpt(dirs["adam"]))
    # switching back by name alone (the oss_* keys of the shipped config are dropped)
    assert load(ckpt(dirs["adam_by_name"]))["cfg"]["optimizer"]["_name"] == "adam"
    assert_same_training_state(ckpt(dirs["adam_by_name"]), ckpt(dirs["adam"]))


def test_user_dir_registers_without_the_import_hook(data, tmp_path):
    """--user-dir pointing at the installed package works on its own; without it (and
    without the hook) oss_adam is unknown, so the first run is not passing by accident."""
    import fairseq_oss

    pkg = os.path.dirname(fairseq_oss.__file__)
    args = [data, *COMMON, "--optimizer", "oss_adam", "--max-update", "2", "--save-dir", str(tmp_path)]
    run([sys.executable, "-c", WITHOUT_HOOK, *args, "--user-dir", pkg], str(tmp_path / "a.log"))
    assert load(ckpt(str(tmp_path)))["cfg"]["optimizer"]["_name"] == "oss_adam"
    proc = subprocess.run([sys.executable, "-c", WITHOUT_HOOK, *args], env=ENV, capture_output=True, text=True)
    assert proc.returncode != 0 and "invalid choice: 'oss_adam'" in proc.stderr


@pytest.mark.quick
def test_a_short_run_saves_in_the_background_and_resumes_at_another_world_size(data, tmp_path):
    """The quick tier's end-to-end run, as a user makes it: fairseq-train with oss_adam on
    2 ranks, saving in the background every 2 updates; the checkpoint verifies, and a
    resume on 1 rank continues from it."""
    d = str(tmp_path / "run")
    log = train(data, d, "oss_adam", 2, 4, extra=["--save-interval-updates", "2", *ASYNC, *DEFAULT_WORKERS])
    assert "asynchronous save of" in log and "Adam state sharded over 2 rank(s)" in log
    rc, out, err = tool("verify", ckpt(d))
    assert rc == 0 and "intact" in out, err
    log = train(data, d, "oss_adam", 1, 6)
    assert "(epoch 1 @ 4 updates)" in log
    assert load(ckpt(d))["optimizer_history"][-1]["num_updates"] == 6

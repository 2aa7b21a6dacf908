"""Launching the real fairseq-train and the fairseq-oss command as users do, for the
end-to-end tests: commands, the environment they run in, and the small model they train.

Assumption: with the same seed, data and world size, fairseq's training is deterministic
on CPU, so any difference in the checkpoints comes from the optimizer.
"""
import hashlib
import os
import signal
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")

# Every option whose parity the issue asks for, in one run: weight decay, polynomial decay
# with warm-up, --clip-norm (computed, but not acting: gnorm is about 1.5 here; see
# CLIPPING), --update-freq, betas. Batches are loaded in the training process
# (--num-workers 0; fairseq's default, one loader process per rank, spawned and so
# importing fairseq again, adds about 2.5 s to each run here and nothing to what the
# tests check: the same batches, the same bits). test_launch_styles and the quick tier's
# run keep fairseq's default.
COMMON = [
    "--task", "language_modeling", "--arch", "transformer_lm",
    "--decoder-layers", "1", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
    "--decoder-attention-heads", "2", "--tokens-per-sample", "32", "--max-tokens", "128",
    "--lr", "0.002", "--lr-scheduler", "polynomial_decay", "--warmup-updates", "3",
    "--total-num-update", "40", "--clip-norm", "5", "--update-freq", "2",
    "--weight-decay", "0.01", "--adam-betas", "(0.9,0.98)",
    "--cpu", "--seed", "1", "--no-epoch-checkpoints", "--disable-validation",
    "--log-format", "simple", "--log-interval", "1", "--num-workers", "0",
]
DEFAULT_WORKERS = ["--num-workers", "1"]  # fairseq's default, overriding COMMON's
# Clipping that acts on every update. With the gradients reduce-scattered, the norm is
# summed from shards in another order than plain adam's per-parameter norms, so where
# clipping acts, oss_adam and adam agree to rounding, not to the bit.
CLIPPING = ["--clip-norm", "0.5"]
# At 3 or more ranks, the reduce-scatter sums each element's N contributions in rank
# order, fairseq's all-reduce in gloo's: the last bits differ, and training amplifies
# them. Measured after 6 updates of these tests' model at 3 ranks, as a fraction of the
# largest value of its kind (checks.assert_close_training_state): oss_adam against adam
# 3e-6, and fairseq's own adam under legacy_ddp against pytorch_ddp 5e-6, both largest in
# an attention key's bias, whose gradient is rounding noise. After 20 updates (model
# weights only): 1.7e-5 and 2.7e-5 at 3 ranks, 2.1e-5 and 1.6e-5 at 4. The bound leaves
# room for the longer runs of the resume tests.
SUM_ORDER_RTOL = 1e-4
FIRST, RESUMED = 6, 10  # updates before the checkpoint, and in all after resuming


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd, timeout, **kwargs):
    """``subprocess.run`` in a session of its own: on a timeout (a hang, which fails the
    test) or Ctrl-C the whole process group is killed, the ranks that fairseq-train started
    included, so that a hung run does not keep the cores busy for the rest of the suite."""
    with subprocess.Popen(cmd, start_new_session=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # the group is gone already
                pass
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run(cmd, log, cwd=None):
    with open(log, "w") as f:
        proc = _run(cmd, 600, stdout=f, stderr=subprocess.STDOUT, env=ENV, cwd=cwd)
    with open(log) as f:
        out = f.read()
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd[:3])}... exited {proc.returncode}\n{out[-4000:]}")
    return out


# fairseq-train with the CPU launch's start method (fairseq_oss/integration/rank_start.py)
# set first, from its first argument: "spawn" (fairseq's, and this package's where fork is
# not safe) or "fork". No flag sets it. Also scripts/bench_launch.py's.
WITH_START_METHOD = (
    "import sys; from fairseq_oss.integration import rank_start; rank_start.START_METHOD = sys.argv.pop(1); "
    "from fairseq_cli.train import cli_main; sys.argv[0] = 'fairseq-train'; cli_main()"
)


def train(data, save_dir, optimizer, world_size, max_update, launch="fairseq", extra=()):
    """Run fairseq-train as a user launches it; returns rank 0's log. ``launch``:
    "fairseq" (fairseq-train starts the ranks: forked on Linux), "spawned" (the same, the
    ranks spawned), "torchrun", or "no-spawn" (one fairseq-train per rank)."""
    os.makedirs(save_dir, exist_ok=True)
    args = [data, *COMMON, "--optimizer", optimizer, "--save-dir", save_dir,
            "--max-update", str(max_update), *extra]
    exe = os.path.join(BIN, "fairseq-train")
    log = os.path.join(save_dir, f"train-{launch}-{world_size}.log")
    if launch in ("fairseq", "spawned"):
        ws = ["--distributed-world-size", str(world_size)] if world_size > 1 else []
        cmd = [exe] if launch == "fairseq" else [sys.executable, "-c", WITH_START_METHOD, "spawn"]
        return run([*cmd, *args, *ws], log)
    if launch == "torchrun":
        return run([os.path.join(BIN, "torchrun"), "--nproc-per-node", str(world_size),
                    "--master-port", str(free_port()), exe, *args], log)
    assert launch == "no-spawn"
    port = free_port()
    procs = []
    for rank in range(world_size):
        cmd = [exe, *args, "--distributed-world-size", str(world_size), "--distributed-rank", str(rank),
               "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-no-spawn"]
        f = open(f"{log}.{rank}", "w")
        procs.append((subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=ENV), f))
    codes = [p.wait(timeout=600) for p, _ in procs]
    for _, f in procs:
        f.close()
    with open(f"{log}.0") as f:
        out = f.read()
    assert codes == [0] * world_size, (codes, out[-4000:])
    return out


def ckpt(d):
    return os.path.join(d, "checkpoint_last.pt")


PLUGIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugins", "faults")


def attempt(cmd, env=None, timeout=300):
    """Run a command that may fail; returns (exit code, output). A hang fails the test."""
    proc = _run(cmd, timeout, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**ENV, **(env or {})})
    return proc.returncode, proc.stdout + proc.stderr


def train_cmd(data, save_dir, optimizer, world_size, max_update, *extra):
    cmd = [os.path.join(BIN, "fairseq-train"), data, *COMMON, "--optimizer", optimizer,
           "--save-dir", save_dir, "--max-update", str(max_update), *extra]
    return cmd + (["--distributed-world-size", str(world_size)] if world_size > 1 else [])


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


ASYNC = ["--write-checkpoints-asynchronously"]


# fairseq-train in a process where the package's .pth did not run: no import hook, and
# fairseq_oss not imported (as for a user who points --user-dir at a source checkout).
WITHOUT_HOOK = (
    "import sys; "
    "sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != '_RegisterAfterFairseq']; "
    "[sys.modules.pop(m) for m in list(sys.modules) if m.split('.')[0] == 'fairseq_oss']; "
    "from fairseq_cli.train import cli_main; sys.argv = ['fairseq-train'] + sys.argv[1:]; cli_main()"
)


TOOL = os.path.join(BIN, "fairseq-oss")


def tool(*args, env=None, timeout=300):
    proc = _run([TOOL, *args], timeout, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env={**ENV, **(env or {})})
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.returncode, proc.stdout, proc.stderr


TRANSLATION = [
    "--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "1",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
    "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
    "--max-tokens", "256", "--optimizer", "oss_adam", "--lr", "0.001", "--cpu", "--seed", "1",
    "--no-epoch-checkpoints", "--log-format", "simple", "--disable-validation", "--num-workers", "0",
]


HUB = """
import sys
from fairseq.models.transformer_lm import TransformerLanguageModel
lm = TransformerLanguageModel.from_pretrained(sys.argv[1], "checkpoint_last.pt", data_name_or_path=sys.argv[2])
lm.eval()
words = open(sys.argv[3]).readline().split()[:6]
scored = lm.score(" ".join(words))
sampled = lm.sample(" ".join(words[:2]), beam=1, sampling=True, sampling_topk=5, max_len_b=4, seed=1)
print("tokens", len(scored["tokens"]), "finite", bool(scored["positional_scores"].isfinite().all()))
print("sample", len(sampled.split()) > 2)
"""

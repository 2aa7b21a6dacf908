"""The CPU launch's start-up: ``fairseq-train --distributed-world-size N`` with its ranks
forked from the launcher (this package's default on Linux, fairseq_oss/integration/rank_start.py)
against the same command with them spawned (fairseq's start method), interleaved (spawn,
fork, spawn, fork ...), median over rounds.

Each figure is the wall time of the whole command, as a user waits for it: the launcher's
imports, the ranks' start, building the model, a few updates and the last save. The model
is the tests' tiny transformer_lm (tests/launch.py's COMMON), so the time is mostly
start-up; both contenders train the same updates and write the same checkpoint (model and
optimizer state compared bit for bit, tests/checks.py; the run fails otherwise).

    python scripts/bench_launch.py [--world-sizes 2 3] [--rounds 3] [--updates 6]
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from checks import assert_same_training_state  # noqa: E402
from launch import COMMON, ENV, WITH_START_METHOD  # noqa: E402 - the tests' model, environment, launch

METHODS = ("spawn", "fork")


def corpus(root):
    out = os.path.join(root, "corpus")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_corpus.py"), out, "--vocab", "300",
                    "--train-lines", "1500", "--valid-lines", "50"], check=True, env=ENV,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return os.path.join(out, "bin")


def run(data, save, method, world_size, updates):
    shutil.rmtree(save, ignore_errors=True)
    cmd = [sys.executable, "-c", WITH_START_METHOD, method, data, *COMMON, "--optimizer", "oss_adam", "--save-dir", save,
           "--max-update", str(updates), "--distributed-world-size", str(world_size)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    seconds = time.perf_counter() - start
    if proc.returncode != 0 or f"starting {world_size} ranks ({method})" not in proc.stdout + proc.stderr:
        raise SystemExit(f"{method} at {world_size} ranks failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--updates", type=int, default=6)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        data = corpus(root)
        times = {(n, m): [] for n in args.world_sizes for m in METHODS}
        for _ in range(args.rounds):
            for n in args.world_sizes:
                for m in METHODS:
                    times[n, m].append(run(data, os.path.join(root, f"{m}-{n}"), m, n, args.updates))
            for n in args.world_sizes:
                assert_same_training_state(*(os.path.join(root, f"{m}-{n}", "checkpoint_last.pt") for m in METHODS))
    print(f"fairseq-train, the tests' model, {args.updates} updates and a save, oss_adam; wall seconds of the whole "
          f"command, median of {args.rounds} interleaved rounds (each round's figures in brackets)")
    print("| ranks | spawned, s | forked, s | forked / spawned |")
    print("|---|---|---|---|")
    for n in args.world_sizes:
        s, f = (statistics.median(times[n, m]) for m in METHODS)
        rounds = lambda m: ", ".join(f"{t:.1f}" for t in times[n, m])  # noqa: E731
        print(f"| {n} | {s:.1f} [{rounds('spawn')}] | {f:.1f} [{rounds('fork')}] | {f / s:.2f}x |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""How much an asynchronous save slows the training that goes on while it runs.

    python scripts/bench_async.py [--rounds 2] [--updates 24] [--save-every 3] [--nice 10]

Runs fairseq-train with ``--optimizer oss_adam --write-checkpoints-asynchronously`` on 2
ranks (bench.py's full model, ~37M parameters), saving every few updates, and splits
each run's steady updates (slowest rank per update) into those during which a save ran in
the background on some rank and those during which none did. The contenders are the
background job at its default CPU priority (``FAIRSEQ_OSS_ASYNC_NICE``, a nice increment
of its thread) and at training's own priority (``FAIRSEQ_OSS_ASYNC_NICE=0``), interleaved
(A B A B). Prints per contender: the median update with a save in flight, without, and
their ratio (the slowdown: the same run, so the machine's drift cancels), the mean update
(what training pays over the run), and the median time a save blocks training (the
snapshot, and waiting for the previous save's job if it is still running; the first save
of a run, which waits for none, is left out). Saves are timed from a clean page cache
(bench_probe: ``sync`` and a barrier before each, outside the timed window).
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402


def one_run(size, data, work, nice, updates, save_every):
    os.makedirs(work)
    env_nice = {"FAIRSEQ_OSS_ASYNC_NICE": str(nice)}
    old = dict(os.environ)
    os.environ.update(env_nice)
    try:
        ranks, _ = bench.fairseq_run(bench.model_args(size, data) + bench.FAIRSEQ["oss_adam async"],
                                     os.path.join(work, "train"), 2, updates, os.path.join(work, "probe"),
                                     extra=["--save-interval-updates", str(save_every)])
    finally:
        os.environ.clear()
        os.environ.update(old)
    blocked = [max(r["saves"][i]["seconds"] for r in ranks) for i in range(len(ranks[0]["saves"]))]
    return bench.updates_by_background_save(ranks) + (blocked[1:],)  # the first save waits for no job


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--updates", type=int, default=24)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--nice", type=int, default=10, help="the lowered contender's nice increment (default 10)")
    args = ap.parse_args(argv)
    size = bench.SIZES["full"]
    work = tempfile.mkdtemp(prefix="fairseq-oss-bench-async-")
    try:
        data_root = os.path.join(work, "data")
        subprocess.run([sys.executable, os.path.join(bench.ROOT, "scripts", "make_corpus.py"), data_root,
                        "--vocab", str(size["vocab"]), "--train-lines", str(size["lines"])],
                       check=True, env=bench.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        data = os.path.join(data_root, "bin")
        samples = {args.nice: ([], [], []), 0: ([], [], [])}
        for r in range(args.rounds):
            for nice in (args.nice, 0):
                print(f"bench_async: round {r + 1}, job nice +{nice} ...", flush=True)
                for kept, got in zip(samples[nice], one_run(size, data, os.path.join(work, f"r{r}-n{nice}"), nice,
                                                            args.updates, args.save_every)):
                    kept.extend(got)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print("| background job | updates with a save in flight, s | without, s | slowdown | mean update, s | "
          "a save blocks training, s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for nice, (busy, idle, blocked) in samples.items():
        b, i = bench.median(busy) if busy else float("nan"), bench.median(idle) if idle else float("nan")
        mean = sum(busy + idle) / len(busy + idle)
        print(f"| nice +{nice} | {b:.2f} (median of {len(busy)}) | {i:.2f} (median of {len(idle)}) | {b / i:.3f}x | "
              f"{mean:.2f} | {bench.median(blocked):.2f} (median of {len(blocked)}) |")


if __name__ == "__main__":
    main()

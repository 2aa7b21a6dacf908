#!/usr/bin/env python3
"""The main job: train a small language model with ``--optimizer oss_adam`` on 2
data-parallel CPU processes, then resume its checkpoint on 1 and on 3 processes.

It runs the real ``fairseq-train`` (fairseq's own launcher spawns the ranks; gloo on CPU),
and prints what happened: losses, Adam-state bytes per rank, checkpoint sizes, and how
the runs compare with ``--optimizer adam`` trained, saved and resumed the same way: bit for
bit, or, where rounding differs (the gradients are reduce-scattered, and ``--clip-norm``
acts here), the largest difference of the parameters and of the logged losses. It fails
if the losses differ by more than rounding explains.

    python scripts/demo.py [--workdir runs/demo] [--updates 60] [--more 30] [--no-adam]
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")

MODEL = [
    "--task", "language_modeling", "--arch", "transformer_lm", "--share-decoder-input-output-embed",
    "--decoder-layers", "2", "--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "256",
    "--decoder-attention-heads", "2", "--tokens-per-sample", "64", "--max-tokens", "512",
    "--lr", "0.002", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "20",
    "--adam-betas", "(0.9,0.98)", "--weight-decay", "0.01", "--clip-norm", "1.0",
    "--cpu", "--seed", "1", "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", "10",
]
# Rounding carried by training moves the 3-decimal losses by a few thousandths at most; a
# wrong gradient or step moves them by far more.
LOSS_TOLERANCE = 0.02
STATE_LINE = re.compile(r"Adam state sharded over (\d+) rank\(s\) in \d+ bucket\(s\): ([\d., ]+) MiB per rank \(plain adam: ([\d.]+) MiB")


def train(data, save_dir, optimizer, world_size, max_update):
    os.makedirs(save_dir, exist_ok=True)
    cmd = [os.path.join(BIN, "fairseq-train"), data, *MODEL, "--optimizer", optimizer,
           "--save-dir", save_dir, "--max-update", str(max_update)]
    if world_size > 1:
        cmd += ["--distributed-world-size", str(world_size)]
    log_path = os.path.join(save_dir, f"train-{world_size}.log")
    t0 = time.time()
    with open(log_path, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=ENV).returncode
    with open(log_path) as f:
        log = f.read()
    if code != 0:
        sys.exit(f"fairseq-train failed ({code}); its log, {log_path}, ends with:\n{log[-3000:]}")
    return log, time.time() - t0


def summarize(name, save_dir, world_size, log, seconds):
    ckpt = os.path.join(save_dir, "checkpoint_last.pt")
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    train_losses = re.findall(r"\| train_inner \| .*? loss=([\d.]+)", log) or re.findall(r"loss=([\d.]+)", log)
    valid = re.findall(r"valid on 'valid' subset \| loss ([\d.]+)", log)
    m = STATE_LINE.search(log)
    per_rank = m.group(2) if m else "?"
    return {
        "run": name,
        "ranks": world_size,
        "updates": state["optimizer_history"][-1]["num_updates"],
        "train loss (last)": train_losses[-1] if train_losses else "?",
        "valid loss": valid[-1] if valid else "?",
        "Adam state per rank, MiB": per_rank,
        "plain adam, MiB/rank": m.group(3) if m else "?",
        "checkpoint, MB": f"{os.path.getsize(ckpt) / 1e6:.2f}",
        "wall, s": f"{seconds:.0f}",
    }


def largest_difference(a_path, b_path):
    """How far apart two checkpoints of one training are: 0.0 when the model and the Adam
    state are equal bit for bit, else the largest difference of a weight, ``exp_avg`` or
    ``exp_avg_sq`` as a fraction of the largest value of its kind; None when they are not
    the same training (other names, shapes, steps or param groups)."""
    a = torch.load(a_path, map_location="cpu", weights_only=False)
    b = torch.load(b_path, map_location="cpu", weights_only=False)
    sa, sb = a["last_optimizer_state"], b["last_optimizer_state"]
    if (a["model"].keys() != b["model"].keys() or sa["param_groups"] != sb["param_groups"]
            or sa["state"].keys() != sb["state"].keys()
            or any(sa["state"][k]["step"] != sb["state"][k]["step"] for k in sa["state"])):
        return None
    kinds = [[(a["model"][k], b["model"][k]) for k in a["model"]]]
    kinds += [[(sa["state"][k][n], sb["state"][k][n]) for k in sa["state"]] for n in ("exp_avg", "exp_avg_sq")]
    worst = 0.0
    for pairs in kinds:
        if any(x.shape != y.shape or x.dtype != y.dtype for x, y in pairs):
            return None
        floats = [(x.double(), y.double()) for x, y in pairs if x.is_floating_point() and x.numel()]
        if any(not torch.equal(x, y) for x, y in pairs if not x.is_floating_point()):
            return None
        scale = max((y.abs().max().item() for _, y in floats), default=0.0)
        diff = max(((x - y).abs().max().item() for x, y in floats), default=0.0)
        worst = max(worst, diff / scale if diff else 0.0)
    return worst


def logged_losses(log):
    """The train and valid losses fairseq logged, in order (3 decimals, as printed)."""
    return [float(x) for x in re.findall(r"\| train_inner \| .*? loss=([\d.]+)|valid on 'valid' subset \| loss ([\d.]+)", log)
            for x in x if x]


def verdict(difference, logs):
    """One line on how oss_adam's run compares with adam's; and whether it is within what
    rounding explains (bit for bit, or the same logged losses to LOSS_TOLERANCE)."""
    if difference is None:
        return "DIFFERENT (not the same training state)", False
    if difference == 0.0:
        return "parameters and Adam state bitwise equal", True
    a, b = (logged_losses(log) for log in logs)
    gap = max((abs(x - y) for x, y in zip(a, b)), default=float("inf")) if len(a) == len(b) else float("inf")
    return (f"parameters differ by up to {difference:.1e} of the largest value, logged losses by at most {gap:.3f} "
            "(the gradients are reduce-scattered: the last bit of their sums or of the clipping norm, "
            "carried by training; see README, Gradients)"), gap <= LOSS_TOLERANCE


def table(rows):
    cols = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    line = lambda vals: "| " + " | ".join(str(v).ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    return "\n".join([line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [line([r[c] for c in cols]) for r in rows])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=os.path.join(ROOT, "runs", "demo"))
    ap.add_argument("--updates", type=int, default=60, help="updates of the first run, on 2 ranks")
    ap.add_argument("--more", type=int, default=30, help="updates after each resume")
    ap.add_argument("--no-adam", action="store_true", help="skip the comparison with --optimizer adam")
    args = ap.parse_args(argv)

    work = os.path.abspath(args.workdir)
    if os.path.exists(work):
        shutil.rmtree(work)
    data_root = os.path.join(work, "data")
    print(f"demo: making a corpus in {data_root}", flush=True)
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_corpus.py"), data_root,
                    "--vocab", "2000", "--train-lines", "4000"],
                   check=True, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    data = os.path.join(data_root, "bin")
    end = args.updates + args.more

    rows, dirs, logs = [], {}, {}
    optimizers = ["oss_adam"] + ([] if args.no_adam else ["adam"])
    for opt in optimizers:
        first = dirs[opt, 2] = os.path.join(work, f"{opt}-2")
        print(f"demo: {opt}: training {args.updates} updates on 2 processes", flush=True)
        log, secs = train(data, first, opt, 2, args.updates)
        logs[opt, 2] = log
        if opt == "oss_adam":
            rows.append(summarize("train", first, 2, log, secs))
        for ws in (1, 3) if opt == "oss_adam" else (3,):  # adam: the comparison needs only 2 -> 3
            d = dirs[opt, 2, ws] = os.path.join(work, f"{opt}-2-to-{ws}")
            shutil.copytree(first, d, ignore=shutil.ignore_patterns("*.log"))
            print(f"demo: {opt}: resuming that checkpoint on {ws} process(es), to update {end}", flush=True)
            log, secs = train(data, d, opt, ws, end)
            logs[opt, 2, ws] = log
            if opt == "oss_adam":
                rows.append(summarize(f"resume 2 -> {ws}", d, ws, log, secs))

    print()
    print(table(rows))
    print()
    if not args.no_adam:
        first = largest_difference(os.path.join(dirs["oss_adam", 2], "checkpoint_last.pt"),
                                   os.path.join(dirs["adam", 2], "checkpoint_last.pt"))
        resumed = largest_difference(os.path.join(dirs["oss_adam", 2, 3], "checkpoint_last.pt"),
                                     os.path.join(dirs["adam", 2, 3], "checkpoint_last.pt"))
        first_line, first_ok = verdict(first, (logs["oss_adam", 2], logs["adam", 2]))
        resumed_line, resumed_ok = verdict(resumed, (logs["oss_adam", 2, 3], logs["adam", 2, 3]))
        print(f"oss_adam vs --optimizer adam, after {args.updates} updates on 2 ranks: {first_line}")
        print(f"oss_adam vs --optimizer adam, saved on 2 ranks and resumed on 3 to update {end}: {resumed_line}")
        if not (first_ok and resumed_ok):
            print("demo: oss_adam and adam trained differently", file=sys.stderr)
            sys.exit(1)
    print(f"checkpoints and logs: {work}")


if __name__ == "__main__":
    main()

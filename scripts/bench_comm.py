"""What an update moves and holds: bytes sent per rank, gradient bytes held, peak resident
memory, and the update's time, for --optimizer adam, fairscale OSS (--zero-sharding os),
PyTorch's ZeroRedundancyOptimizer (registered by the probe as zero_adam), and oss_adam
with its gradients reduce-scattered (the default) or all-reduced (--oss-grad-reduction
all_reduce), through the real fairseq-train with a counting probe (scripts/comm_probe).

Counts (bytes, gradient bytes) come from one run per contender and world size: they do
not depend on the machine's load. Times come from separate runs without the counting
hook, interleaved (A B C A B C ...), at 2 ranks; each figure is the median over rounds of
the per-run median over updates 3 and later. Prints a table and writes it, with the raw
figures, to bench-results/comm.md and comm.json.

    python scripts/bench_comm.py [--world-sizes 2 3 4] [--rounds 3] [--updates 10] [--precision amp]

``--precision`` trains every contender in that fairseq mode (fp16: ``--fp16``'s flat fp32
master copy; memory-efficient-fp16; amp) and writes comm-PRECISION.md/json instead; a
contender that cannot train in it is reported as "-". ``--bucket-mb 4`` adds -4mb to the name;
``--glibc-tunables T`` runs every contender with GLIBC_TUNABLES=T (glibc's malloc set alike
for all: oss_adam leaves it alone then) and adds -tunables.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (model_args, env, BIN, ROOT)

PROBE = os.path.join(bench.ROOT, "scripts", "comm_probe")
# The shape: a 4-layer transformer_lm of about 7M parameters (fp32 gradients ~28 MB).
SIZE = dict(vocab=8000, lines=4000, dim=256, ffn=1024, layers=4, tokens=64, max_tokens=512)
CONTENDERS = {
    "adam": ["--optimizer", "adam"],
    "fairscale OSS": ["--optimizer", "adam", "--zero-sharding", "os", "--ddp-backend", "legacy_ddp"],
    "ZeroRedundancyOptimizer": ["--optimizer", "zero_adam"],
    "oss_adam all_reduce": ["--optimizer", "oss_adam", "--oss-grad-reduction", "all_reduce"],
    "oss_adam reduce_scatter": ["--optimizer", "oss_adam"],
}
TIMED = ["adam", "ZeroRedundancyOptimizer", "oss_adam all_reduce", "oss_adam reduce_scatter"]
PRECISIONS = {"fp32": [], "fp16": ["--fp16"], "memory-efficient-fp16": ["--memory-efficient-fp16"], "amp": ["--amp"]}
# fairseq refuses fairscale OSS and ZeroRedundancyOptimizer over --fp16's flat master copy,
# and says to add this flag (one fp32 master copy per parameter).
NO_FLAT_MASTER = {"fairscale OSS", "ZeroRedundancyOptimizer"}


def run(name, data, work, world_size, updates, count, bucket_mb=None, precision="fp32", tunables=None):
    out = os.path.join(work, f"probe-{name.replace(' ', '_')}-{world_size}-{count}-{time.time_ns()}")
    cmd = [os.path.join(bench.BIN, "fairseq-train"), *bench.model_args(SIZE, data), *CONTENDERS[name],
           "--save-dir", os.path.join(work, "save"), "--no-save", "--max-update", str(updates),
           "--user-dir", PROBE, *PRECISIONS[precision]]
    if precision == "fp16" and name in NO_FLAT_MASTER:
        cmd.append("--fp16-no-flatten-grads")
    if world_size > 1:
        cmd += ["--distributed-world-size", str(world_size)]
    if bucket_mb is not None and "oss_adam" in name:
        cmd += ["--oss-bucket-mb", str(bucket_mb)]
    env = dict(bench.env(), COMM_PROBE_OUT=out)
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    if count:
        env["COMM_PROBE_COUNT"] = "1"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} at {world_size} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return bench.read_ranks(out, world_size)


def steady(values):
    return statistics.median(values[2:] if len(values) > 3 else values)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds at 2 ranks (0: none)")
    ap.add_argument("--updates", type=int, default=10)
    ap.add_argument("--bucket-mb", type=float, default=None, help="oss_adam's --oss-bucket-mb (default: its own)")
    ap.add_argument("--precision", choices=list(PRECISIONS), default="fp32", help="fairseq's precision mode for every contender")
    ap.add_argument("--glibc-tunables", default=None,
                    help="GLIBC_TUNABLES for every contender (oss_adam then keeps glibc's malloc settings as they are)")
    args = ap.parse_args(argv)
    t0 = time.time()
    work = tempfile.mkdtemp(prefix="fairseq-oss-comm-")
    data_root = os.path.join(work, "data")
    subprocess.run([sys.executable, os.path.join(bench.ROOT, "scripts", "make_corpus.py"), data_root,
                    "--vocab", str(SIZE["vocab"]), "--train-lines", str(SIZE["lines"])],
                   check=True, env=bench.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    data = os.path.join(data_root, "bin")
    counts = {}
    for ws in args.world_sizes:
        for name in CONTENDERS:
            print(f"bench_comm: counting {name} at {ws} ranks ...", flush=True)
            try:
                ranks = run(name, data, work, ws, 6, count=True, bucket_mb=args.bucket_mb, precision=args.precision,
                            tunables=args.glibc_tunables)
            except RuntimeError as e:
                if name == "adam":
                    raise
                print(f"bench_comm: {name} does not train with --precision {args.precision}: {str(e)[-300:]}")
                continue
            counts[f"{name}@{ws}"] = {
                "sent": statistics.mean(steady(r["sent"]) for r in ranks),
                "grad_bytes": max(steady(r["grad_bytes"]) for r in ranks),
            }
    times = {name: {"seconds": [], "after_backward": [], "optimizer": [], "from_last_grad": [],
                    "from_last_grad_done_last": [], "peak_rss_mb": [], "minor_faults": []} for name in TIMED}
    for i in range(args.rounds):
        for name in TIMED:
            print(f"bench_comm: timing round {i + 1}: {name} ...", flush=True)
            ranks = run(name, data, work, 2, args.updates, count=False, bucket_mb=args.bucket_mb,
                        precision=args.precision, tunables=args.glibc_tunables)
            r0 = ranks[0]
            times[name]["peak_rss_mb"].append(max(r["peak_rss_mb"] for r in ranks))
            times[name]["minor_faults"].append(max(steady(r["minor_faults"]) for r in ranks))
            times[name]["seconds"].append(steady(r0["seconds"]))
            times[name]["after_backward"].append(steady(r0["after_backward"]))
            # what training waits for the optimizer: after backward, and for parameters later
            times[name]["optimizer"].append(steady([a + w for a, w in zip(r0["after_backward"], r0["param_wait"])]))
            # the same from the last gradient backward produced: DDP's reduction tail included
            times[name]["from_last_grad"].append(
                steady([a + w for a, w in zip(r0["after_last_grad"], r0["param_wait"])]))
            # per update, the rank whose backward ended last (the smaller figure): it waits for no
            # other rank's backward, so its figure holds the optimizer's own time, not the ranks' skew
            spans = [[a + w for a, w in zip(r["after_last_grad"], r["param_wait"])] for r in ranks]
            times[name]["from_last_grad_done_last"].append(steady([min(u) for u in zip(*spans)]))

    lines = ["| contender | " + " | ".join(f"MB sent/rank/update N={ws} (x adam)" for ws in args.world_sizes)
             + " | grad MB held/rank N=2 | " + ("s/update N=2 (x adam) | after backward s (x adam) "
                                                 "| after backward + parameter waits s (x adam) "
                                                 "| after the last gradient + parameter waits s (x adam) "
                                                 "| the same, the rank done last s (x adam) "
                                                 "| peak RSS MB N=2 | minor page faults/update N=2 |"
                                                 if args.rounds else ""),
             "|---" * (1 + len(args.world_sizes) + 1 + (7 if args.rounds else 0)) + "|"]
    for name in CONTENDERS:
        cells = []
        for ws in args.world_sizes:
            c, base = counts.get(f"{name}@{ws}"), counts[f"adam@{ws}"]
            cells.append(f"{c['sent'] / 1e6:.1f} ({c['sent'] / base['sent']:.2f}x)" if c else "-")
        held = counts.get(f"{name}@2", {}).get("grad_bytes")
        cells.append(f"{held / 1e6:.1f}" if held is not None else "-")
        if args.rounds:
            if name in times:
                s, a = statistics.median(times[name]["seconds"]), statistics.median(times[name]["after_backward"])
                bs = statistics.median(times["adam"]["seconds"])
                ba = statistics.median(times["adam"]["after_backward"])
                o = statistics.median(times[name]["optimizer"])
                bo = statistics.median(times["adam"]["optimizer"])
                g, bg = (statistics.median(times[n]["from_last_grad"]) for n in (name, "adam"))
                d, bd = (statistics.median(times[n]["from_last_grad_done_last"]) for n in (name, "adam"))
                cells += [f"{s:.3f} ({s / bs:.2f}x)", f"{a:.4f} ({a / ba:.2f}x)", f"{o:.4f} ({o / bo:.2f}x)",
                          f"{g:.4f} ({g / bg:.2f}x)", f"{d:.4f} ({d / bd:.2f}x)",
                          f"{statistics.median(times[name]['peak_rss_mb']):.0f}",
                          f"{statistics.median(times[name]['minor_faults']):.0f}"]
            else:
                cells += ["-"] * 7
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    note = (f"Model: transformer_lm, {SIZE['layers']} layers of dim {SIZE['dim']}, vocabulary {SIZE['vocab']} "
            f"(tied embedding); oss_adam's buckets {args.bucket_mb or 32} MiB; {args.precision} "
            f"({' '.join(PRECISIONS[args.precision]) or 'no precision flag'}"
            f"{'; fairscale OSS and ZeroRedundancyOptimizer with --fp16-no-flatten-grads, as fairseq asks' if args.precision == 'fp16' else ''}), gloo, ranks are processes on this machine; {time.time() - t0:.0f} s in all. "
            "Bytes: counted at the collectives as NCCL's ring algorithms send them, mean over ranks, median over "
            "updates 3 and later. Grad MB held: the largest rank, after the reduction (the parameters' .grad, "
            "--fp16's fp32 master gradient, oss_adam's shards and buffers). Times: interleaved rounds, "
            "rank 0 unless said, medians. After backward: from the end of the last backward to the end of the step; parameter "
            "waits: the time the update then spends waiting for parameters that the previous step left in flight "
            "(oss_adam reduce_scatter: its exchange behind the next forward). After the last gradient: from the "
            "moment the last backward produced its last gradient (the last of the parameters' post-accumulate-grad "
            "hooks) to the end of the step, so that PyTorch's DDP's reduction tail, which it waits for inside "
            "backward, counts as oss_adam's does after it; both include the wait for the other rank. The same, the rank "
            "done last: per update, the smaller of the two ranks' figures, that of the rank whose backward ended "
            "last, which waits for no other rank's backward (rank 0's figure holds that wait whenever rank 0 ended "
            "first), median over updates 3 and later, median over rounds. Peak RSS: the larger rank's peak resident "
            "memory over a timing run (ru_maxrss; model, data, torch and fairseq included), median over rounds. "
            "Minor page faults: per update (ru_minflt), the larger rank's median over updates 3 and later, median "
            "over rounds: pages the update touched fresh from the kernel (oss_adam keeps glibc's freed memory "
            "between updates on CPU: fairseq_oss/integration/malloc.py)"
            + (f". Every contender ran with GLIBC_TUNABLES={args.glibc_tunables}." if args.glibc_tunables else "."))
    table = "\n".join(lines)
    print(table)
    print(note)
    out_dir = os.path.join(bench.ROOT, "bench-results")
    os.makedirs(out_dir, exist_ok=True)
    stem = "comm" + ("" if args.precision == "fp32" else f"-{args.precision}")
    stem += "" if args.bucket_mb is None else f"-{args.bucket_mb:g}mb"
    stem += "" if args.glibc_tunables is None else "-tunables"
    command = " ".join(["python scripts/bench_comm.py", *(argv if argv is not None else sys.argv[1:])])
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(f"Measured {time.strftime('%Y-%m-%d')} (`{command}`).\n\n{table}\n\n{note}\n")
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump({"counts": counts, "times": times, "size": SIZE}, f, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Benchmark: plain Adam, fairscale OSS, PyTorch's ZeroRedundancyOptimizer and oss_adam
(with and without --write-checkpoints-asynchronously), on the same transformer_lm and
data, on CPU with gloo; then checkpoint saves and loads as the model and N grow.

    python scripts/bench.py [--quick] [--out bench-results] [--no-scaling]

For each contender: a run on 2 ranks that saves every few updates and goes on (seconds per
update and per optimizer step at steady state, optimizer state on the largest rank against
total/N, peak memory, the time each save blocks training, from a clean page cache, and the
writer's memory rise, checkpoint size), then resumes of the half-way checkpoint on 1, 2 and
4 ranks (wall time and each rank's memory rise during the load, and whether the resume on 2
ranks ends with the same parameters as the uninterrupted run, and those on 1 and 4 ranks as
plain adam's resumes). Then one more 2-rank run of each contender in turn, for timing:
seconds are medians over both runs' steady updates, so that a machine whose speed drifts
over the minutes between contenders skews them less.

Then the scaling table (scripts/bench_save.py): save and load time and memory of adam and
oss_adam (synchronous, and what an asynchronous save blocks) for the bench model and one of
about 150M parameters, at N = 1, 2 and 4, contenders interleaved, medians over repeats.

Prints markdown tables with ratios to plain Adam, writes them to OUT/results.md with the
raw figures (OUT/results.json) and a chart (OUT/results.png).

The fairseq contenders run the real fairseq-train with a measuring probe
(scripts/bench_probe, --user-dir); fairseq has no switch for ZeroRedundancyOptimizer, so it
runs in a small training loop here, on the same model, data and batches.
"""
import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
PROBE = os.path.join(ROOT, "scripts", "bench_probe")

SIZES = {
    # vocab ~20k words (the embedding dominates), ~37M parameters
    "full": dict(vocab=20000, lines=12000, dim=512, ffn=2048, layers=8, tokens=128, max_tokens=1024, updates=16,
                 save_every=4),
    "quick": dict(vocab=8000, lines=4000, dim=256, ffn=1024, layers=2, tokens=64, max_tokens=512, updates=8,
                  save_every=2),
}
FAIRSEQ = {
    "adam": ["--optimizer", "adam"],
    "fairscale OSS": ["--optimizer", "adam", "--zero-sharding", "os"],
    "oss_adam": ["--optimizer", "oss_adam"],
    "oss_adam async": ["--optimizer", "oss_adam", "--write-checkpoints-asynchronously"],
}
CONTENDERS = ["adam", "fairscale OSS", "ZeroRedundancyOptimizer", "oss_adam", "oss_adam async"]
# the save and load scaling table (scripts/bench_save.py): models, world sizes, contenders
SCALING = {"full": (["bench", "150M"], [1, 2, 4], 5), "quick": (["bench"], [1, 2], 3)}
SCALING_CONTENDERS = ("adam", "oss parallel", "oss async")


def model_args(size, data):
    return [
        data, "--task", "language_modeling", "--arch", "transformer_lm", "--share-decoder-input-output-embed",
        "--decoder-layers", str(size["layers"]), "--decoder-embed-dim", str(size["dim"]),
        "--decoder-ffn-embed-dim", str(size["ffn"]), "--decoder-attention-heads", "4",
        "--tokens-per-sample", str(size["tokens"]), "--max-tokens", str(size["max_tokens"]),
        "--lr", "0.0005", "--adam-betas", "(0.9,0.98)", "--weight-decay", "0.01",
        "--cpu", "--seed", "1", "--disable-validation", "--no-epoch-checkpoints",
        "--log-format", "simple", "--log-interval", "100", "--num-workers", "0",
    ]


def env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def fairseq_run(args, save_dir, world_size, max_update, probe_out, extra=()):
    cmd = [os.path.join(BIN, "fairseq-train"), *args, "--save-dir", save_dir, "--max-update", str(max_update),
           "--user-dir", PROBE, *extra]
    if world_size > 1:
        cmd += ["--distributed-world-size", str(world_size)]
    e = env()
    e["BENCH_PROBE_OUT"] = probe_out
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=e, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:2])} ... failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return read_ranks(probe_out, world_size), wall


def read_ranks(probe_out, world_size):
    """Every rank's probe record (``rank{R}.json`` in ``probe_out``), in rank order."""
    ranks = []
    for r in range(world_size):
        with open(os.path.join(probe_out, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    return ranks


def same_params(a, b):
    sa = torch.load(a, map_location="cpu", weights_only=False)
    sb = torch.load(b, map_location="cpu", weights_only=False)
    ma, mb = sa.get("model", sa), sb.get("model", sb)
    return ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)


def bench_fairseq(name, size, data, work, baseline=None):
    """One contender through fairseq-train; returns its figures. With ``baseline`` (plain
    adam's figures, its files still on disk), each resume is also compared with adam's
    resume at the same world size: fairseq's data order depends on the world size, so
    that, not the uninterrupted 2-rank run, is what a resume at 1 or 4 ranks must equal."""
    args = model_args(size, data) + FAIRSEQ[name]
    half, full = size["updates"] // 2, size["updates"]
    run_dir = os.path.join(work, "train")
    ranks, _ = fairseq_run(args, run_dir, 2, full, os.path.join(work, "probe-train"),
                           extra=["--save-interval-updates", str(size["save_every"])])
    mid = os.path.join(run_dir, f"checkpoint_1_{half}.pt")
    out = train_figures(ranks, os.path.getsize(mid))
    out["mid"] = mid
    out["resume"] = {}
    for ws in (1, 2, 4):
        d = os.path.join(work, f"resume{ws}")
        os.makedirs(d)
        os.link(mid, os.path.join(d, "checkpoint_last.pt"))
        try:
            rranks, wall = fairseq_run(args, d, ws, full, os.path.join(work, f"probe-resume{ws}"))
        except RuntimeError as e:  # reported in the table, e.g. fairscale OSS needs torch.distributed
            last = [line for line in str(e).splitlines() if "Error" in line][-1:] or ["failed"]
            out["resume"][ws] = {"error": last[0].strip()[:120]}
            continue
        entry = {"load_seconds": max(r["loads"][0]["seconds"] for r in rranks),
                 "load_rise": [r["loads"][0]["rise"] for r in rranks],
                 "state_bytes": [r["state_bytes"] for r in rranks]}
        entry["final"] = os.path.join(d, "checkpoint_last.pt")
        if ws == 2:
            entry["continues"] = same_params(entry["final"], os.path.join(run_dir, "checkpoint_last.pt"))
        base = (baseline or {}).get("resume", {}).get(ws, {}).get("final")
        if base is not None:
            entry["same_as_adam"] = same_params(entry["final"], base)
        out["resume"][ws] = entry
    return out


def steady(seconds):
    """The updates after warm-up (the first ones build buffers and caches)."""
    return seconds[3:] if len(seconds) > 5 else seconds[1:]


def median(values):
    return sorted(values)[len(values) // 2]


def same_training_state(a, b):
    """Two checkpoints hold the same model and optimizer state, bit for bit."""
    sa = torch.load(a, map_location="cpu", weights_only=False)
    sb = torch.load(b, map_location="cpu", weights_only=False)
    oa, ob = sa["last_optimizer_state"]["state"], sb["last_optimizer_state"]["state"]
    return same_params(a, b) and oa.keys() == ob.keys() and all(
        oa[i]["step"] == ob[i]["step"] and all(torch.equal(oa[i][k], ob[i][k]) for k in ("exp_avg", "exp_avg_sq"))
        for i in oa)


def updates_by_background_save(ranks):
    """The steady updates' seconds (slowest rank), split by whether an asynchronous save
    ran in the background during them on any rank: (in flight, none)."""
    seconds = steady([max(u) for u in zip(*(r["update_seconds"] for r in ranks))])
    flags = steady([any(f) for f in zip(*(r.get("update_save_in_flight") or [False] * len(r["update_seconds"])
                                          for r in ranks))])
    return [s for s, f in zip(seconds, flags) if f], [s for s, f in zip(seconds, flags) if not f]


def train_figures(ranks, ckpt_bytes):
    """A save blocks training until the last rank is back: per save, the max over ranks."""
    saves = [max(r["saves"][i]["seconds"] for r in ranks) for i in range(len(ranks[0]["saves"]))]
    busy, idle = updates_by_background_save(ranks)
    return {
        "update_samples": steady(ranks[0]["update_seconds"]),
        "update_samples_save_in_flight": busy,
        "update_samples_no_save_in_flight": idle,
        "step_samples": steady(ranks[0]["step_seconds"]),
        "state_bytes": [r["state_bytes"] for r in ranks],
        "peak_rss": [r["peak_rss"] for r in ranks],
        "save_samples": saves,
        "save_seconds": median(saves),
        "save_writer_rise": max(s["rise"] for s in ranks[0]["saves"]),
        "checkpoint_bytes": ckpt_bytes,
    }


# ---------------------------------------------------------------- ZeroRedundancyOptimizer


def _zero_worker(rank, world_size, port, size, data, plan, out_dir):
    """Same model and batches as fairseq-train, DDP + ZeroRedundancyOptimizer(AdamW)."""
    import resource

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from fairseq import options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq_oss.memory import PeakRss as Peak

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    parser = options.get_training_parser()
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(parser, model_args(size, data) + ["--optimizer", "adam"]))
    task = tasks.setup_task(cfg.task)
    task.load_dataset("train")
    torch.manual_seed(1)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    from fairseq.distributed import ModuleProxyWrapper

    ddp = ModuleProxyWrapper(DistributedDataParallel(model))  # the criterion calls model methods
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=5e-4,
                                  betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    itr = task.get_batch_iterator(dataset=task.dataset("train"), max_tokens=size["max_tokens"],
                                  max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
                                  seed=1, num_shards=world_size, shard_id=rank).next_epoch_itr(shuffle=True)
    record = {"update_seconds": [], "step_seconds": [], "saves": [], "loads": []}
    start, end = plan["start"], plan["end"]
    if plan.get("load"):
        with Peak() as p:
            ckpt = torch.load(plan["load"], map_location="cpu", weights_only=False)  # every rank reads it all
            model.load_state_dict(ckpt["model"])
            try:
                opt.load_state_dict(ckpt["optimizer"])
                record["load_error"] = None
            except Exception as e:  # noqa: BLE001 - reported, not hidden
                record["load_error"] = f"{type(e).__name__}: {e}"[:200]
            del ckpt
        record["loads"].append({"seconds": p.seconds, "rise": p.rise})
    batches = list(itr)
    for update in range(start, end):
        sample = batches[update % len(batches)]
        torch.manual_seed(1 + update)
        t0 = time.perf_counter()
        loss, sample_size, _ = criterion(ddp, sample)
        (loss / max(sample_size, 1)).backward()
        t1 = time.perf_counter()
        opt.step()
        record["step_seconds"].append(time.perf_counter() - t1)
        opt.zero_grad(set_to_none=True)
        record["update_seconds"].append(time.perf_counter() - t0)
        if update == start:
            record["state_bytes"] = sum(v.numel() * v.element_size() for s in opt.optim.state.values()
                                        for v in s.values() if torch.is_tensor(v))
        if plan.get("save_every") and (update + 1) % plan["save_every"] == 0:
            os.sync()  # a clean page cache, as for the fairseq contenders (scripts/bench_probe)
            dist.barrier()
            path = plan["save"] if update + 1 == plan["save_at"] else plan["save"] + ".other"
            with Peak() as p:
                opt.consolidate_state_dict(to=0)
                if rank == 0:
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
                dist.barrier()
            record["saves"].append({"seconds": p.seconds, "rise": p.rise})
    if rank == 0 and plan.get("final"):
        torch.save({"model": model.state_dict()}, plan["final"])
    record["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def zero_run(size, data, world_size, plan, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    torch.multiprocessing.start_processes(_zero_worker, args=(world_size, _free_port(), size, data, plan, out_dir),
                                          nprocs=world_size, start_method="spawn")
    wall = time.perf_counter() - t0
    ranks = []
    for r in range(world_size):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    return ranks, wall


def timing_round(name, size, data, work):
    """One more 2-rank training run without saving: rank 0's steady update and step times."""
    probe = os.path.join(work, "probe")
    if name == "ZeroRedundancyOptimizer":
        ranks, _ = zero_run(size, data, 2, {"start": 0, "end": size["updates"]}, probe)
    else:
        ranks, _ = fairseq_run(model_args(size, data) + FAIRSEQ[name], os.path.join(work, "save"), 2,
                               size["updates"], probe, extra=["--no-save"])
    return steady(ranks[0]["update_seconds"]), steady(ranks[0]["step_seconds"])


def bench_zero(size, data, work):
    half, full = size["updates"] // 2, size["updates"]
    mid, final = os.path.join(work, "mid.pt"), os.path.join(work, "final.pt")
    ranks, _ = zero_run(size, data, 2, {"start": 0, "end": full, "save_at": half, "save": mid, "final": final,
                                        "save_every": size["save_every"]}, os.path.join(work, "probe-train"))
    out = train_figures(ranks, os.path.getsize(mid))
    out["resume"] = {}
    for ws in (1, 2, 4):
        resumed = os.path.join(work, f"resumed{ws}.pt")
        rranks, _ = zero_run(size, data, ws, {"start": half, "end": full, "load": mid, "final": resumed},
                             os.path.join(work, f"probe-resume{ws}"))
        errors = {r.get("load_error") for r in rranks} - {None}
        entry = {"load_seconds": max(r["loads"][0]["seconds"] for r in rranks),
                 "load_rise": [r["loads"][0]["rise"] for r in rranks],
                 "state_bytes": [r.get("state_bytes") for r in rranks],
                 "load_error": sorted(errors)[0] if errors else None}
        if ws == 2:
            entry["continues"] = same_params(resumed, final) and not errors
        out["resume"][ws] = entry
    return out


# ---------------------------------------------------------------- report

MB = 1e6


def fmt_ratio(value, base):
    return f"{value:.3g} ({value / base:.2f}x)" if base else f"{value:.3g}"


def report(results, size, machine):
    base = results["adam"]
    rows = []
    head = ["contender", "s/update (N=2)", "optimizer step s (N=2)", "state on largest rank / (total/N), N=2", "same, N=4",
            "peak RSS MB (max rank)", "save: training blocked s", "writer rise MB (save)", "checkpoint MB",
            "resume N=1: s / max rise MB", "N=2", "N=4", "resumed = uninterrupted (N=2)",
            "resumed at N=1, 4 = adam resumed so"]
    total = base["state_bytes"][0]  # plain adam replicates: every rank holds all of it

    def balance(states, n):
        states = [s for s in states if s is not None]
        return max(states) / (total / n) if states else float("nan")

    for name in CONTENDERS:
        r = results.get(name)
        if r is None:
            continue
        res = r["resume"]
        cells = [
            name,
            fmt_ratio(r["seconds_per_update"], base["seconds_per_update"]),
            fmt_ratio(r["step_seconds"], base["step_seconds"]),
            f"{balance(r['state_bytes'], 2):.3f}",
            f"{balance(res[4]['state_bytes'], 4):.3f}" if "state_bytes" in res[4] else "n/a",
            fmt_ratio(max(r["peak_rss"]) / MB, max(base["peak_rss"]) / MB),
            fmt_ratio(r["save_seconds"], base["save_seconds"]),
            f"{r['save_writer_rise'] / MB:.1f}",
            fmt_ratio(r["checkpoint_bytes"] / MB, base["checkpoint_bytes"] / MB),
        ]
        for ws in (1, 2, 4):
            e = res[ws]
            if "error" in e:
                cells.append(f"fails ({e['error']})")
                continue
            cell = f"{e['load_seconds']:.2f} / {max(e['load_rise']) / MB:.0f}"
            if e.get("load_error"):
                cell += " (optimizer state not loaded)"
            cells.append(cell)
        cells.append("yes" if res.get(2, {}).get("continues") else "no")
        if name in ("adam", "ZeroRedundancyOptimizer"):
            cells.append("(baseline)" if name == "adam" else "n/a (AdamW)")
        else:
            same = [res[ws].get("same_as_adam") for ws in (1, 4)]
            cells.append(" / ".join({True: "yes", False: "no", None: "n/a"}[v] for v in same))
        rows.append(cells)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(c) + " |" for c in rows]
    params = total / 8  # two fp32 tensors per parameter
    saves = len(base["save_samples"])
    from fairseq_oss.integration.rank_start import START_METHOD  # how fairseq-train started the ranks
    launched = "forked" if START_METHOD == "fork" else "spawned"
    notes = [
        f"Saves: every {size['save_every']} updates ({saves} per run); each from a clean page cache (`sync` and a "
        "barrier before it, outside the timed window), timed from there until the last rank is back in training "
        "(the max over ranks); the median over the run's saves. adam, fairscale OSS and ZeroRedundancyOptimizer: "
        "rank 0's `torch.save` without fsync (the file may still be in the page cache when training resumes); "
        "oss_adam: every rank writes its shards of the Adam state and 1/N of the weights, fsync'd and renamed into "
        "place; oss_adam async: `--write-checkpoints-asynchronously`, the time the snapshot blocks training (the "
        "writing goes on in the background, during the next updates). Contenders run one after the other, minutes "
        "apart: the interleaved comparison of saves is the scaling table below.",
        f"Model: transformer_lm, {size['layers']} layers, dim {size['dim']}, vocabulary {size['vocab']}, "
        f"{params / 1e6:.1f}M parameters (Adam state {total / MB:.0f} MB); {size['updates']} updates, "
        f"checkpoint after {size['updates'] // 2}; {machine}.",
        "Ratios are to plain adam. State balance: the largest rank's optimizer state over total/N (1.000 is perfect). "
        "Rises are resident-memory rises of the process during the save or load (sampled every ms). "
        "Peak RSS: each rank's `ru_maxrss`; the fairseq contenders' ranks are started by fairseq-train's CPU launch "
        f"({launched} from its launcher: a forked rank's peak counts the torch and fairseq pages it shares with the "
        "launcher, a spawned rank those it imported itself), ZeroRedundancyOptimizer's are spawned by this script. "
        "Resumed = uninterrupted: the parameters after the resume on 2 ranks equal those of the run that was not "
        "interrupted, bit for bit; at 1 and 4 ranks fairseq's data order differs, so the parameters are compared "
        "with plain adam's resume from its own checkpoint at the same world size (ZeroRedundancyOptimizer runs AdamW: "
        "not comparable).",
    ]
    background = results.get("oss_adam async", {})
    busy, idle = background.get("update_samples_save_in_flight"), background.get("update_samples_no_save_in_flight")
    if busy and idle:
        notes.append(f"oss_adam async: an update during which a save runs in the background takes {median(busy):.2f} s "
                     f"(median of {len(busy)}), one with none {median(idle):.2f} s (median of {len(idle)}): "
                     f"{median(busy) / median(idle):.2f}x (slowest rank per update, same run).")
    same = results.get("oss_adam async", {}).get("same_state_as_sync")
    if same is not None:
        notes.append("oss_adam async's half-way checkpoint holds the same model and Adam state as oss_adam's, bit for "
                     f"bit: {'yes' if same else 'NO'}.")
    return "\n".join(lines), notes


def bench_scaling(quick):
    """Save and load, adam against oss_adam, as the model and N grow (scripts/bench_save.py:
    in-process ranks, the contenders interleaved, medians over repeats)."""
    import bench_save

    models, world_sizes, repeats = SCALING["quick" if quick else "full"]
    rows = []
    for model in models:
        for ws in world_sizes:
            print(f"bench: scaling, {model} model, N={ws} ...", flush=True)
            r = bench_save.measure(bench_save.MODELS[model], ws, repeats, SCALING_CONTENDERS)
            rows.append({"model": model, "world_size": ws, **r})
    return rows


def scaling_report(rows):
    head = ["model", "N", "file MB", "adam save s", "oss_adam save s (x adam)", "oss_adam async: blocked s (x adam)",
            "save rise MB: adam / oss / async", "adam load s / rise MB", "oss_adam load s / rise MB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        t = {c: median(v) for c, v in r["save_seconds"].items()}
        # each round's ratio to adam's save of the same round, then their median: the machine's
        # drift between rounds cancels out of a ratio taken within one
        ratio = {c: median([x / a for x, a in zip(v, r["save_seconds"]["adam"])]) for c, v in r["save_seconds"].items()}
        rise = {c: max(v) / MB for c, v in r["save_rise"].items()}
        loads = {k: (median([x[0] for x in v]), max(x[1] for x in v) / MB) for k, v in r["loads"].items()}
        base = t["adam"]
        lines.append("| " + " | ".join([
            f"{r['model']} ({r['params'] / 1e6:.0f}M)", str(r["world_size"]),
            f"{r['sizes']['oss parallel'] / MB:.0f}",
            f"{base:.2f}", f"{t['oss parallel']:.2f} ({ratio['oss parallel']:.2f}x)",
            f"{t['oss async']:.2f} ({ratio['oss async']:.2f}x)",
            f"{rise['adam']:.0f} / {rise['oss parallel']:.0f} / {rise['oss async']:.0f}",
            f"{loads['adam'][0]:.2f} / {loads['adam'][1]:.0f}", f"{loads['oss'][0]:.2f} / {loads['oss'][1]:.0f}",
        ]) + " |")
    notes = [
        "Scaling (scripts/bench_save.py): a transformer_lm-shaped model (tied embedding, 20k vocabulary; the bench "
        "model, and 12 layers of dim 1024, ffn 3072) with one Adam step taken; ranks are processes of one machine "
        "(gloo). Contenders interleaved (adam, oss_adam, async, adam, ...), medians over the repeats; a ratio is the "
        "median over rounds of the contender's time over adam's in the same round. Saves from a "
        "clean page cache (`sync` before each, outside the window), timed from a barrier to the last rank's "
        "return (max over ranks). adam: rank 0's `torch.save` of the model and the full Adam state, tmp + rename, "
        "no fsync. oss_adam: every rank writes its shards and 1/N of the weights (N=1: the one rank writes all), "
        "CRCs, fsync, rename. async: the blocking snapshot only. Rises: the largest rise of any rank's resident "
        "memory during the save (async: its snapshot, whose buffers are kept for the next save) or the load. "
        "Loads from the page cache (the files were just written): adam, every rank `torch.load`s the whole file "
        "and loads the model; oss_adam, every rank maps the file, loads the model and reads its own slices of the "
        "state.",
    ]
    return "\n".join(lines), notes


def chart(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in CONTENDERS if n in results]
    fig, axes = plt.subplots(1, 5, figsize=(20, 4))
    panels = [
        ("s / update (N=2)", [results[n]["seconds_per_update"] for n in names]),
        ("optimizer step, s (N=2)", [results[n]["step_seconds"] for n in names]),
        ("largest rank's state, MB (N=2)", [max(results[n]["state_bytes"]) / MB for n in names]),
        ("writer's memory rise at save, MB", [results[n]["save_writer_rise"] / MB for n in names]),
        ("max rank's memory rise at resume on 4, MB",
         [max(results[n]["resume"][4].get("load_rise", [0])) / MB for n in names]),
    ]
    for ax, (title, values) in zip(axes, panels):
        ax.bar(range(len(names)), values, color=["#888", "#c84", "#48c", "#4a4", "#8c8"][: len(names)])
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=20, fontsize=8)
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller model and fewer updates (under 5 minutes)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench-results"))
    ap.add_argument("--only", nargs="*", choices=CONTENDERS, help="run these contenders only")
    ap.add_argument("--no-scaling", action="store_true", help="skip the save and load scaling table")
    args = ap.parse_args(argv)
    size = SIZES["quick" if args.quick else "full"]
    names = args.only or CONTENDERS
    if "adam" not in names:
        names = ["adam"] + names  # the baseline of every ratio
    t0 = time.time()
    work = tempfile.mkdtemp(prefix="fairseq-oss-bench-")
    try:
        data_root = os.path.join(work, "data")
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_corpus.py"), data_root,
                        "--vocab", str(size["vocab"]), "--train-lines", str(size["lines"])],
                       check=True, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        data = os.path.join(data_root, "bin")
        results = {}
        names = [n for n in CONTENDERS if n in names]
        for name in names:
            print(f"bench: {name} ...", flush=True)
            d = os.path.join(work, name.replace(" ", "_"))
            os.makedirs(d)
            if name == "ZeroRedundancyOptimizer":
                results[name] = bench_zero(size, data, d)
            else:
                results[name] = bench_fairseq(name, size, data, d, baseline=results.get("adam"))
        if "oss_adam" in results and "oss_adam async" in results:
            results["oss_adam async"]["same_state_as_sync"] = same_training_state(
                results["oss_adam"]["mid"], results["oss_adam async"]["mid"])
        # Timing drifts on a shared machine over the minutes between contenders: one more
        # training run of each, in turn, and the medians over both runs' steady updates.
        for name in names:
            print(f"bench: timing round, {name} ...", flush=True)
            d = os.path.join(work, name.replace(" ", "_"), "timing")
            os.makedirs(d)
            updates, steps = timing_round(name, size, data, d)
            results[name]["update_samples"] += updates
            results[name]["step_samples"] += steps
        for r in results.values():
            r["seconds_per_update"] = median(r["update_samples"])
            r["step_seconds"] = median(r["step_samples"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    scaling = [] if args.no_scaling else bench_scaling(args.quick)
    machine = f"{os.cpu_count()} CPU cores, {platform.machine()}, torch {torch.__version__}, gloo"
    table, notes = report(results, size, machine)
    stamp = time.strftime("%Y-%m-%d")
    text = f"Measured {stamp} ({'quick' if args.quick else 'full'} run, {time.time() - t0:.0f} s).\n\n{table}\n\n" + "\n".join(notes) + "\n"
    if scaling:
        stable, snotes = scaling_report(scaling)
        text += "\n## Saves and loads as the model and N grow\n\n" + stable + "\n\n" + "\n".join(snotes) + "\n"
    print()
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text)
    for r in results.values():  # the checkpoints were in the deleted work directory
        r.pop("mid", None)
        for entry in r["resume"].values():
            entry.pop("final", None)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"size": size, "machine": machine, "date": stamp, "results": results, "scaling": scaling}, f,
                  indent=1)
    try:
        chart(results, os.path.join(args.out, "results.png"))
    except ImportError:
        print("bench: matplotlib is not installed, no chart (scripts/bench.sh installs it)")
    print(f"bench: wrote {args.out}/results.md, results.json, results.png")


if __name__ == "__main__":
    main()

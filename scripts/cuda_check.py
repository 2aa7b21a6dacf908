#!/usr/bin/env python3
"""oss_adam on CUDA GPUs, in one run of a few minutes: what the CPU tests cannot show.

Not a test (CI has no GPU; the suite runs on CPU with gloo). For a machine with a GPU:

1. fairseq-train at one rank on the GPU, in every precision mode fairseq-train offers on
   GPUs (fp32, ``--fp16``, ``--memory-efficient-fp16``, ``--amp``; its ``--bf16`` and
   ``--memory-efficient-bf16`` turn on ``--tpu``, which oss_adam refuses): adam, adam
   again (the control: the GPU's own run-to-run difference) and oss_adam with
   ``--write-checkpoints-asynchronously`` (its snapshot stages CUDA tensors in pinned
   memory), each saving half way and at the end. The checkpoints' weights and Adam state
   are compared bit for bit, half way and at the end.
2. In one process, NCCL at world size 1: CUDA tensors through the gradient hooks, one
   ``reduce_scatter_tensor`` per bucket, the sharded step with its exchange deferred,
   against fairseq's Adam on the same gradients, bit for bit; and ``--fp16``'s layout (an
   fp16 model over a flat fp32 master copy: fp16 reduce-scatter into the master's shard,
   the updated shard written into the model) against fairseq's fp16 Adam, bit for bit.
3. Two ranks on the one GPU under NCCL, to say why nothing here runs NCCL at two ranks:
   NCCL refuses two ranks on one device (multi-rank NCCL needs a machine with two GPUs).
4. The optimizer step alone, ShardedAdam against fairseq's Adam (and torch's foreach and
   fused AdamW, for scale), interleaved, medians; one rank, so no communication.
5. fairseq-train's updates per second at one rank, adam against oss_adam, in fp32 and
   with ``--amp``, on a 6-layer transformer_lm: runs one after the other, interleaved
   (adam, oss_adam, adam, oss_adam), the median of fairseq's logged ``ups`` after warm-up.
6. On a machine with two GPUs or more: fairseq-train at one rank per GPU under NCCL, every
   mode of part 1, clipping off: oss_adam (reduce-scattered, saving asynchronously) bit for
   bit with adam at 2 ranks; beyond, within twice what adam under ``legacy_ddp`` differs
   from adam (the sum's order). Skipped with one GPU.

    python scripts/cuda_check.py DATA_BIN OUT_DIR [--device cpu] [--parts 123456] [--ranks N]

``--device cpu`` dry-runs parts 1, 2, 4, 5 and 6 (at 2 ranks, fp32 only) on CPU (gloo), to
check the script itself.
Prints a report; exits 1 if a parity check fails.
"""
import argparse
import concurrent.futures
import os
import site
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

MODES = {
    "fp32": [],
    "fp16": ["--fp16"],
    "memory_efficient_fp16": ["--memory-efficient-fp16"],
    "amp": ["--amp"],
}
HALF, UPDATES = 10, 20


def lm(layers, dim, tokens, *extra, decay_updates=40):
    """fairseq-train flags for a transformer_lm of ``layers`` layers of width ``dim`` (4x in
    the feed-forward, heads of 32), ``tokens`` per sample, 16 samples per batch, trained as
    the tests train it (learning rate decaying to 0 over ``decay_updates``, clipping, weight
    decay), plus ``extra``."""
    return [
        "--task", "language_modeling", "--arch", "transformer_lm", "--decoder-layers", str(layers),
        "--decoder-embed-dim", str(dim), "--decoder-ffn-embed-dim", str(4 * dim),
        "--decoder-attention-heads", str(dim // 32), "--tokens-per-sample", str(tokens),
        "--max-tokens", str(16 * tokens), "--lr", "0.0005", "--lr-scheduler", "polynomial_decay",
        "--warmup-updates", "5", "--total-num-update", str(decay_updates), "--clip-norm", "1.0", "--weight-decay", "0.01",
        "--adam-betas", "(0.9,0.98)", "--seed", "1", "--num-workers", "0", "--disable-validation", *extra,
    ]


MODEL = lm(2, 128, 64, "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", "1",
           "--max-update", str(UPDATES), "--save-interval-updates", str(HALF), "--fp16-init-scale", "4096")
# Where the package is installed, its .pth registers oss_adam (and a --user-dir pointing at
# this checkout would be a second fairseq_oss); on a machine where it is only on PYTHONPATH,
# --user-dir registers it.
INSTALLED = any(os.path.exists(os.path.join(d, "fairseq_oss.pth")) for d in site.getsitepackages())
USER_DIR = [] if INSTALLED else ["--user-dir", os.path.join(ROOT, "fairseq_oss")]
FAILED = []


def check(ok, what):
    print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        FAILED.append(what)


# ---------------------------------------------------------------- 1. fairseq-train


def _train(data, out, mode, name, device, world_size=1):
    """One fairseq-train run: ``name`` is adam, adam_again (the control), adam_legacy (adam
    under ``--ddp-backend legacy_ddp``) or oss_adam (saving asynchronously). At more than
    one rank clipping is off (``--clip-norm 0``), so that 2 ranks compare bit for bit."""
    save = os.path.join(out, "train", f"{mode}-{name}" + (f"-{world_size}" if world_size > 1 else ""))
    if os.path.exists(os.path.join(save, "checkpoint_last.pt")):  # fairseq-train would resume it
        raise RuntimeError(f"{save} holds an earlier run: give a fresh OUT_DIR")
    os.makedirs(save, exist_ok=True)
    opt = "oss_adam" if name == "oss_adam" else "adam"
    extra = ["--write-checkpoints-asynchronously"] if opt == "oss_adam" else []
    extra += ["--ddp-backend", "legacy_ddp"] if name == "adam_legacy" else []
    extra += ["--cpu"] if device == "cpu" else []
    extra += ["--distributed-world-size", str(world_size), "--clip-norm", "0"] if world_size > 1 else []
    cmd = [sys.executable, "-m", "fairseq_cli.train", data, *MODEL, *USER_DIR, *MODES[mode], *extra,
           "--optimizer", opt, "--save-dir", save]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=420)
    log = proc.stdout + proc.stderr
    with open(os.path.join(save, "train.log"), "w") as f:
        f.write(log)
    return {"rc": proc.returncode, "log": log, "dir": save, "s": time.monotonic() - start}


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _differences(a_path, b_path):
    """(tensors that differ, largest difference, largest |value|) over weights and Adam state."""
    a, b = _load(a_path), _load(b_path)
    pairs = [(a["model"][k], b["model"][k]) for k in b["model"]]
    sa, sb = a["last_optimizer_state"]["state"], b["last_optimizer_state"]["state"]
    if list(sa) != list(sb):
        return None
    for k in sb:
        pairs += [(sa[k][key], sb[k][key]) for key in ("exp_avg", "exp_avg_sq")]
        if sa[k]["step"] != sb[k]["step"]:
            return None
    differ, largest, scale = 0, 0.0, 0.0
    for x, y in pairs:
        if x.dtype != y.dtype or x.shape != y.shape:
            return None
        if not torch.equal(x, y):
            differ += 1
            largest = max(largest, (x.double() - y.double()).abs().max().item())
        scale = max(scale, y.double().abs().max().item() if y.numel() else 0.0)
    return differ, largest, scale, len(pairs)


def part_training(data, out, device):
    print(f"\n1. fairseq-train, one rank on {device}: {UPDATES} updates, saves at {HALF} and {UPDATES}", flush=True)
    jobs = [(m, n) for m in MODES for n in ("adam", "adam_again", "oss_adam")]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs) if device == "cuda" else 2) as pool:
        runs = dict(zip(jobs, pool.map(lambda j: _train(data, out, j[0], j[1], device), jobs)))
    for mode in MODES:
        print(f" {mode}:", flush=True)
        bad = [n for n in ("adam", "adam_again", "oss_adam") if runs[mode, n]["rc"] != 0]
        for n in bad:
            print("\n".join(runs[mode, n]["log"].splitlines()[-25:]))
        check(not bad, f"{mode}: every run exits 0 ({', '.join(bad) or 'none failed'})")
        if bad:
            continue
        log = runs[mode, "oss_adam"]["log"]
        overflows = [runs[mode, n]["log"].count("overflow detected") for n in ("adam", "oss_adam")]
        print(f"    overflows (adam, oss_adam): {overflows}; seconds: "
              + ", ".join(f"{n} {runs[mode, n]['s']:.0f}" for n in ("adam", "adam_again", "oss_adam")))
        check(overflows[0] == overflows[1], f"{mode}: oss_adam skips the updates adam skips")
        check("Adam state sharded over 1 rank(s)" in log, f"{mode}: oss_adam ran")
        for name in (f"checkpoint_1_{HALF}.pt", "checkpoint_last.pt"):
            paths = {n: os.path.join(runs[mode, n]["dir"], name) for n in ("adam", "adam_again", "oss_adam")}
            control = _differences(paths["adam_again"], paths["adam"])
            got = _differences(paths["oss_adam"], paths["adam"])
            print(f"    {name}: adam again vs adam {_words(control)}; oss_adam vs adam {_words(got)}")
            check(got is not None and (got[0] == 0 or (control is not None and control[0] > 0)),
                  f"{mode} {name}: oss_adam equals adam bit for bit (or adam is not repeatable here)")


def _words(d):
    if d is None:
        return "DIFFERENT STRUCTURE"
    differ, largest, scale, n = d
    if differ == 0:
        return f"identical ({n} tensors)"
    return f"{differ}/{n} tensors differ, by up to {largest:.3g} ({largest / max(scale, 1e-300):.2g} of the largest value)"


# ---------------------------------------------------------------- 6. N ranks


def _checkpoints(save_dir):
    """The checkpoints a run saved: the one at update HALF (``checkpoint_EPOCH_HALF.pt``,
    unless an epoch ended there, when fairseq writes ``checkpoint_last.pt`` only) and the
    last."""
    return sorted(f for f in os.listdir(save_dir) if f.startswith("checkpoint_") and f.endswith(".pt"))


def part_ranks(data, out, device, ranks=None):
    """fairseq-train at ``ranks`` ranks (default: one per GPU; 2 on CPU), each mode: adam,
    adam again, oss_adam under the reduce-scatter (NCCL's reduce_scatter_tensor and
    all_gather_into_tensor on GPUs) and, beyond 2 ranks, adam under legacy_ddp."""
    n = ranks or (torch.cuda.device_count() if device == "cuda" else 2)
    modes = list(MODES) if device == "cuda" else ["fp32"]  # the dry run checks the script, briefly
    print(f"\n6. fairseq-train at {n} ranks on {device}: {UPDATES} updates, saves at {HALF} and {UPDATES}, "
          "no clipping", flush=True)
    if n < 2:
        print("  skipped: one GPU (NCCL refuses two ranks on one device: part 3)")
        return
    names = ["adam", "adam_again", "oss_adam"] + (["adam_legacy"] if n > 2 else [])
    for mode in modes:
        runs = {name: _train(data, out, mode, name, device, n) for name in names}  # one at a time: all GPUs each
        print(f" {mode}: seconds " + ", ".join(f"{k} {r['s']:.0f}" for k, r in runs.items()), flush=True)
        bad = [k for k, r in runs.items() if r["rc"] != 0]
        for k in bad:
            print("\n".join(runs[k]["log"].splitlines()[-25:]))
        check(not bad, f"{mode} at {n} ranks: every run exits 0 ({', '.join(bad) or 'none failed'})")
        if bad:
            continue
        log = runs["oss_adam"]["log"]
        check(f"Adam state sharded over {n} rank(s)" in log and "gradients reduce-scattered" in log,
              f"{mode} at {n} ranks: oss_adam ran, its gradients reduce-scattered")
        overflows = [runs[k]["log"].count("overflow detected") for k in ("adam", "oss_adam")]
        check(overflows[0] == overflows[1], f"{mode} at {n} ranks: oss_adam skips the updates adam skips {overflows}")
        names = _checkpoints(runs["adam"]["dir"])
        check(all(_checkpoints(r["dir"]) == names for r in runs.values()) and "checkpoint_last.pt" in names,
              f"{mode} at {n} ranks: every run saved {names}")
        for name in names:
            paths = {k: os.path.join(r["dir"], name) for k, r in runs.items()}
            control = _differences(paths["adam_again"], paths["adam"])
            got = _differences(paths["oss_adam"], paths["adam"])
            print(f"    {name}: adam again vs adam {_words(control)}; oss_adam vs adam {_words(got)}")
            if n == 2:  # a sum of two values does not depend on its order
                check(got is not None and (got[0] == 0 or (control is not None and control[0] > 0)),
                      f"{mode} {name}: oss_adam equals adam bit for bit (or adam is not repeatable here)")
                continue
            backends = _differences(paths["adam_legacy"], paths["adam"])
            print(f"    {name}: adam legacy_ddp vs adam {_words(backends)}")
            check(got is not None and backends is not None and got[1] <= 2 * backends[1] + 1e-12 * got[2],
                  f"{mode} {name}: oss_adam within twice fairseq's own backend-to-backend difference of adam")


# ---------------------------------------------------------------- 2. in process, NCCL


def part_in_process(device):
    import torch.distributed as dist
    from fairseq.optim.adam import Adam

    from fairseq_oss.optim.grad_reduction import GradReducer, total_norm
    from fairseq_oss.optim.sharded_adam import ShardedAdam
    from models import SMALL_BUCKET, lr_at, make_model, param_groups

    backend = "nccl" if device == "cuda" else "gloo"
    print(f"\n2. In process, {backend} at world size 1 on {device}: hooks, reduce_scatter_tensor, deferred exchange", flush=True)
    rdv = tempfile.NamedTemporaryFile(delete=False).name
    os.unlink(rdv)
    kwargs = {"device_id": torch.device("cuda:0")} if device == "cuda" else {}
    dist.init_process_group(backend, init_method=f"file://{rdv}", rank=0, world_size=1, **kwargs)
    torch.use_deterministic_algorithms(True)
    try:
        model, ref = make_model().to(device), make_model().to(device)
        opt = ShardedAdam(param_groups(model, 1e-3), betas=(0.9, 0.98), eps=1e-6, bucket_bytes=SMALL_BUCKET,
                          defer_exchange=True)
        ref_opt = Adam(param_groups(ref, 1e-3), betas=(0.9, 0.98), eps=1e-6)
        reducer = GradReducer(opt, method="reduce_scatter", unused="skip")
        print(f"  {len(opt.partition.buckets)} buckets, parameters on {opt.params[0].device}")
        norms = []
        for step in range(1, 7):
            opt.param_exchange.wait_all()  # the next forward reads the parameters
            opt.zero_grad()
            reducer.reset()
            ref.zero_grad(set_to_none=True)
            g = torch.Generator().manual_seed(step)
            idx = torch.randint(0, 300, (5,), generator=g).to(device)
            w = torch.randn(5, 3, generator=g).to(device)
            for m in (model, ref):
                h = m["fc2"](torch.relu(m["fc1"](m["embed"](idx))))
                (m["sometimes"](h) * w).sum().backward()
            early = reducer._next
            reducer.finish()
            norms.append((total_norm(opt.reduced_grads(), None, opt.params).item(),
                          torch.norm(torch.stack([p.grad.norm() for p in ref.parameters() if p.grad is not None])).item()))
            for o in (opt, ref_opt):
                for group in o.param_groups:
                    group["lr"] = lr_at(step) * (0.5 if group.get("weight_decay") else 1.0)
            opt.step()
            ref_opt.step()
        opt.param_exchange.wait_all()
        torch.cuda.synchronize() if device == "cuda" else None
        same = [torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters())]
        check(all(same), f"parameters after 6 steps equal fairseq Adam's bit for bit ({sum(same)}/{len(same)})")
        check(early > 0, f"buckets reduced during backward, before finish ({early})")
        check(all(abs(a - b) <= 1e-6 * b for a, b in norms), f"gradient norm from the shards = adam's ({norms[-1]})")
        check(all(p.grad is None for p in opt.params), "no full .grad kept after the reduction")
        # --fp16's layout: an fp16 model over a flat fp32 master copy, reduced in fp16 into
        # the master's shard, the updated shard written into the fp16 model
        from fp16_master import master_job

        r = master_job(0, 1, "reduce_scatter", "all_gather", device)
        check(all(all(eq) for eq in r["equal"]) and r["master_shards_equal"],
              f"--fp16 layout: fp16 parameters after {len(r['equal'])} steps equal fairseq's fp16 Adam's bit for bit")
        check(r["dtypes"] == {"torch.float32"} and all(r["master_grad"]),
              "--fp16 layout: fp32 shards handed to the step, no full gradient kept")
    finally:
        torch.use_deterministic_algorithms(False)
        dist.destroy_process_group()


# ---------------------------------------------------------------- 3. two ranks, one GPU

_TWO_RANKS = """
import os, sys, torch, torch.distributed as dist
rank = int(sys.argv[1])
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=2)
t = torch.ones(4, device="cuda")
dist.all_reduce(t)
print("all_reduce gave", t.tolist())
"""


def part_two_ranks():
    print("\n3. Two ranks on the one GPU with NCCL", flush=True)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_RANKS, str(r), port], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    for p in procs:
        try:
            out, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += "\n(killed after 60 s)"
        lines = [ln for ln in out.splitlines() if "Duplicate GPU" in ln or "gave" in ln or "Error" in ln]
        print(f"  rank exit {p.returncode}: {' | '.join(lines[-3:]) or out.strip()[-300:]}")


# ---------------------------------------------------------------- 4. step time


def part_step_time(device):
    from fairseq.optim.adam import Adam

    from fairseq_oss.optim.sharded_adam import ShardedAdam

    n, shape = (120, (1024, 1024)) if device == "cuda" else (8, (256, 256))
    print(f"\n4. The step alone, one rank on {device}: {n} tensors of {shape[0]}x{shape[1]} fp32 "
          f"({n * shape[0] * shape[1] / 1e6:.0f}M parameters), medians of 20, interleaved", flush=True)
    torch.manual_seed(0)

    def params():
        ps = [torch.nn.Parameter(torch.randn(shape, device=device) * 0.02) for _ in range(n)]
        for p in ps:
            p.grad = torch.randn_like(p) * 1e-3
        return ps

    kw = {"lr": 1e-3, "betas": (0.9, 0.98), "eps": 1e-8, "weight_decay": 0.01}
    contenders = {
        "fairseq adam": Adam(params(), **kw),
        "oss_adam (ShardedAdam)": ShardedAdam(params(), **kw),
        "torch AdamW foreach": torch.optim.AdamW(params(), foreach=True, **kw),
    }
    if device == "cuda":
        contenders["torch AdamW fused"] = torch.optim.AdamW(params(), fused=True, **kw)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = {k: [] for k in contenders}
    for rep in range(23):
        for name, opt in contenders.items():
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            if rep >= 3:
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["fairseq adam"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:24s} {m * 1e3:8.2f} ms  ({m / base:.2f}x fairseq adam)")


# ---------------------------------------------------------------- 5. updates per second

SPEED_FLAGS = ("--no-save", "--log-format", "json", "--log-interval", "10")


def part_speed(data, out, device, updates=160, rounds=2):
    import json

    model = lm(6, 512, 128, *SPEED_FLAGS, decay_updates=1000)
    if device == "cpu":  # the dry run: a model that CPU trains in seconds
        model, updates = lm(1, 64, 32, *SPEED_FLAGS, decay_updates=1000), 60

    print(f"\n5. fairseq-train updates per second, one rank on {device}: {updates} updates, "
          f"{rounds} rounds interleaved, median of the logged ups after update 40", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for mode, flags in (("fp32", []), ("amp", ["--amp"])):
        ups = {"adam": [], "oss_adam": []}
        for _ in range(rounds):
            for opt in ups:
                cmd = [sys.executable, "-m", "fairseq_cli.train", data, *model, *USER_DIR, *flags,
                       "--optimizer", opt, "--max-update", str(updates), "--save-dir", os.path.join(out, "speed")]
                cmd += ["--cpu"] if device == "cpu" else []
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
                if proc.returncode != 0:
                    print((proc.stdout + proc.stderr)[-3000:])
                    check(False, f"{mode} {opt}: fairseq-train exited {proc.returncode}")
                    return
                for line in (proc.stdout + proc.stderr).splitlines():
                    if '"train_inner"' in line or "train_inner" in line and "{" in line:
                        rec = json.loads(line[line.index("{"):])
                        if int(rec["num_updates"]) > 40:
                            ups[opt].append(float(rec["ups"]))
        a, o = statistics.median(ups["adam"]), statistics.median(ups["oss_adam"])
        print(f"  {mode}: adam {a:.2f} updates/s, oss_adam {o:.2f} updates/s: an update takes {a / o:.2f}x adam's time "
              f"({len(ups['adam'])} and {len(ups['oss_adam'])} intervals)", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("data")
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--parts", default="123456")
    ap.add_argument("--ranks", type=int, help="ranks of part 6 (default: one per GPU; 2 on CPU)")
    args = ap.parse_args()
    if args.device == "cuda":
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}, "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    start = time.monotonic()
    for part, fn in (("2", lambda: part_in_process(args.device)), ("4", lambda: part_step_time(args.device)),
                     ("1", lambda: part_training(args.data, args.out, args.device)),
                     ("3", part_two_ranks), ("6", lambda: part_ranks(args.data, args.out, args.device, args.ranks)),
                     ("5", lambda: part_speed(args.data, args.out, args.device))):
        if part in args.parts and not (part == "3" and args.device != "cuda"):
            try:
                fn()
            except Exception as e:  # report and go on: one part's failure must not hide the others'
                import traceback

                traceback.print_exc()
                check(False, f"part {part} raised {type(e).__name__}: {e}")
    print(f"\n{len(FAILED)} check(s) failed in {time.monotonic() - start:.0f} s" + "".join(f"\n  {f}" for f in FAILED))
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()

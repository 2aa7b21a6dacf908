"""Checkpoint save and load time and memory, at N ranks: plain adam against oss_adam.

A transformer_lm-shaped model (its parameters, not its compute) with one Adam step taken,
in-process gloo ranks; each contender saves the same training state. What is timed is
what training waits for: from a barrier to the last rank being released (the max over
ranks of each rank's time).

Saves (``sync`` before each, outside the timed window: the page cache holds no dirty
pages from the previous save, as between real saves minutes apart):
- ``adam``: stock fairseq's save: rank 0 pickles the model and the full Adam state
  (``torch.save`` to ``NAME.tmp`` + rename, *no fsync*: its writeback happens later,
  outside the window); ``adam+fsync`` adds the fsync that makes it durable, as
  oss_adam's saves are;
- ``oss streamed``: rank 0 writes the weights and the Adam state it gathers (as with
  ``--oss-no-shared-fs``); ``oss parallel``: every rank writes its shards of the state and
  1/N of the weights (fairseq-train's default). Both: CRCs, fsync, rename, directory fsync;
- ``oss async``: what ``--write-checkpoints-asynchronously`` blocks training for: the ranks
  agreeing that they see the file, every rank's snapshot of its shards and its 1/N of the
  weights, rank 0's copy of the small entries, the start of the background job (the job
  itself is waited for outside the timed window).
Loads (of the file each contender wrote last; from the page cache): ``adam``: every rank
``torch.load``s the whole file and loads the model (as ``--load-checkpoint-on-all-dp-ranks``);
``oss``: every rank maps the file, loads the model from it and reads its own slices of the
state (``fairseq_oss.checkpoint.load_optimizer_state``), as fairseq-train does with oss_adam.
Memory: the largest rise of any rank's resident memory during the save or load.
Contenders interleaved (A B C A B C ...), medians over --repeats.

Usage: python scripts/bench_save.py [--model bench 150M] [--world-size 2] [--repeats 3] [--dir DIR]
"""
import argparse
import os
import queue
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONTENDERS = ("adam", "adam+fsync", "oss streamed", "oss parallel", "oss async")
# transformer_lm shapes: the bench model of scripts/bench.py, and one of about 150M parameters
MODELS = {
    "bench": dict(layers=8, dim=512, ffn=2048, vocab=20000),
    "150M": dict(layers=12, dim=1024, ffn=3072, vocab=20000),
}


def transformer_lm(layers, dim, ffn, vocab):
    """A module with transformer_lm's parameters (tied input/output embedding)."""
    m = torch.nn.Module()
    m.embed_tokens = torch.nn.Embedding(vocab, dim)
    m.layers = torch.nn.ModuleList()
    for _ in range(layers):
        layer = torch.nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(layer, name, torch.nn.Linear(dim, dim))
        layer.fc1, layer.fc2 = torch.nn.Linear(dim, ffn), torch.nn.Linear(ffn, dim)
        layer.attn_norm, layer.final_norm = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        m.layers.append(layer)
    m.layer_norm = torch.nn.LayerNorm(dim)
    return m


def _worker(rank, world_size, port, shape, repeats, directory, contenders, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    from fairseq_oss.checkpoint import async_save
    from fairseq_oss.checkpoint import load_optimizer_state, save_optimizer_state
    from fairseq_oss.checkpoint.format import CheckpointWriter
    from fairseq_oss.memory import PeakRss
    from fairseq_oss.checkpoint.model_weights import ModelWeights, with_placeholders, with_shell
    from fairseq_oss.optim.sharded_adam import ShardedAdam

    torch.manual_seed(0)
    module = transformer_lm(**shape)
    params = list(module.parameters())
    opt = ShardedAdam(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    full = None
    if rank == 0:  # plain adam's checkpoint content: the full state, as every adam rank holds it
        full = {i: {"step": 1, "exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}
                for i, p in enumerate(params)}
    times = {c: [] for c in contenders}
    rises = {c: [] for c in contenders}
    loads = {c: [] for c in ("adam", "oss")}
    paths = {}

    def save(contender, path):
        if contender.startswith("adam"):
            if rank == 0:
                tmp = path + ".tmp"
                with open(tmp, "wb") as f:
                    torch.save({"model": module.state_dict(), "last_optimizer_state": {"state": full,
                                                                                       "param_groups": []}}, f)
                    if contender == "adam+fsync":
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, path)
            return None
        writer = CheckpointWriter(directory) if rank == 0 else None
        weights = ModelWeights.of(module.state_dict())
        if contender == "oss async":
            job = async_save.begin(opt, writer, weights, None, world_size, shared_fs=True)
            if rank == 0:
                job.hand_off({"model": module.state_dict(), "last_optimizer_state": async_save.pending_state_dict(opt)},
                             path)
            job.close_copies()
            return job
        state = save_optimizer_state(opt, writer, shared_fs=contender == "oss parallel", weights=weights)
        if rank == 0:
            obj = with_shell({"model": module.state_dict(), "last_optimizer_state": state}, weights)
            writer.finish(with_placeholders(obj, weights), path)
        return None

    for _ in range(repeats):
        for contender in contenders:
            path = paths[contender] = os.path.join(directory, f"checkpoint_{contender.replace(' ', '_')}.pt")
            if rank == 0:
                os.sync()
            dist.barrier()
            with PeakRss() as m:
                t0 = time.perf_counter()
                job = save(contender, path)
                times[contender].append(time.perf_counter() - t0)
            rises[contender].append(m.rise)
            if job is not None:
                job.join()  # outside the timed window: training would go on meanwhile
                assert job.error is None, job.error
            dist.barrier()
        for kind, contender in (("adam", "adam"), ("oss", "oss parallel")):
            if contender not in paths:
                continue
            dist.barrier()
            with PeakRss() as m:
                t0 = time.perf_counter()
                if kind == "adam":
                    ckpt = torch.load(paths[contender], map_location="cpu", weights_only=True)
                    module.load_state_dict(ckpt["model"])
                else:
                    ckpt = torch.load(paths[contender], map_location="cpu", mmap=True, weights_only=True)
                    module.load_state_dict(ckpt["model"])
                    load_optimizer_state(opt, paths[contender])
                del ckpt
                seconds = time.perf_counter() - t0
            loads[kind].append((seconds, m.rise))
            dist.barrier()
    sizes = {c: os.path.getsize(p) for c, p in paths.items()} if rank == 0 else None
    out.put((rank, times, rises, loads, sizes, sum(p.numel() for p in params)))
    dist.barrier()
    dist.destroy_process_group()


def measure(shape, world_size, repeats, contenders=CONTENDERS, directory=None):
    """Per contender: save seconds and save memory rises (max over ranks, per repeat);
    per load kind: (seconds, rise) per repeat (max over ranks); file sizes; parameters."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(dir=directory) as d:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, shape, repeats, d, contenders, out))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results = []
        while len(results) < world_size:
            try:
                results.append(out.get(timeout=5))
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    for p in procs:
                        p.kill()
                    raise RuntimeError(f"a rank of the measurement failed (exit codes {failed}): see its traceback")
        for p in procs:
            p.join()
    by_rank = sorted(results, key=lambda r: r[0])
    times = {c: [max(r[1][c][i] for r in by_rank) for i in range(repeats)] for c in contenders}
    rises = {c: [max(r[2][c][i] for r in by_rank) for i in range(repeats)] for c in contenders}
    loads = {k: [(max(r[3][k][i][0] for r in by_rank), max(r[3][k][i][1] for r in by_rank))
                 for i in range(len(by_rank[0][3][k]))] for k in by_rank[0][3]}
    return {"save_seconds": times, "save_rise": rises, "loads": loads, "sizes": by_rank[0][4],
            "params": by_rank[0][5]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", nargs="+", default=["bench", "150M"], choices=sorted(MODELS))
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    print(f"world size {args.world_size}, seconds training is blocked: medians of {args.repeats} (min-max), "
          "and the median over rounds of the ratio to adam's save of the same round")
    print(f"{'params':>8} {'file':>9} " + " ".join(f"{c:>26}" for c in CONTENDERS))
    for name in args.model:
        r = measure(MODELS[name], args.world_size, args.repeats, directory=args.dir)
        cells = []
        for c in CONTENDERS:
            t = r["save_seconds"][c]
            ratio = statistics.median([x / a for x, a in zip(t, r["save_seconds"]["adam"])])
            cells.append(f"{statistics.median(t):5.2f} ({min(t):.2f}-{max(t):.2f}) {ratio:.2f}x")
        size = r["sizes"]["oss parallel"]
        print(f"{r['params'] / 1e6:>7.0f}M {size / 2**20:>7.0f}Mi " + " ".join(f"{c:>26}" for c in cells))


if __name__ == "__main__":
    main()

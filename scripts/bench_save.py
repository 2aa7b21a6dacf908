"""Checkpoint save time: oss_adam's streamed save (rank 0 gathers and writes everything),
its parallel save (every rank writes its own shard of the Adam state into the one file),
and plain adam's (rank 0's ``torch.save`` of the model and the full Adam state).

What is timed: the time training is blocked, on rank 0 (the last rank to be released):
from a barrier to the file being complete under its final name.
- ``adam``: stock fairseq's save, ``torch.save`` to ``NAME.tmp`` + rename, *no fsync*
  (its writeback happens later, outside the timed window; ``adam+fsync`` adds the fsync
  that makes it durable, as oss_adam's saves are);
- ``oss streamed`` / ``oss parallel``: ``consolidate_state_dict`` + ``CheckpointWriter.finish``
  (CRCs, fsync, rename, directory fsync), as in fairseq-train;
- ``oss async``: what ``--write-checkpoints-asynchronously`` blocks training for: every rank's
  snapshot of its shards, rank 0's copy of the model and the small entries, the start of
  the background job (the job itself is waited for outside the timed window).
Each save starts from a clean page cache for writeback: ``sync`` before each, outside the
timed window. Contenders interleaved (A B C D A B C D ...), medians over --repeats.
In-process gloo ranks, fp32 parameters, one Adam step taken before the saves.

Usage: python scripts/bench_save.py [--params 35e6 150e6] [--world-size 2] [--repeats 3] [--dir DIR]
"""
import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONTENDERS = ("adam", "adam+fsync", "oss streamed", "oss parallel", "oss async")


def _worker(rank, world_size, port, numel, repeats, directory, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    from fairseq_oss import async_save
    from fairseq_oss.checkpoint_format import CheckpointWriter
    from fairseq_oss.sharded_adam import ShardedAdam

    background = async_save.background_group(None)

    torch.manual_seed(0)
    # a transformer-like mix: one large embedding, then square-ish matrices
    sizes, left = [], numel
    sizes.append(min(left, numel // 5))
    left -= sizes[0]
    while left > 0:
        sizes.append(min(left, 1024 * 1024))
        left -= sizes[-1]
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    opt = ShardedAdam(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    full = None
    if rank == 0:  # plain adam's checkpoint content: the full state, as every adam rank holds it
        full = {i: {"step": 1, "exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}
                for i, p in enumerate(params)}
    model = {f"p{i}": p.detach() for i, p in enumerate(params)}
    times = {c: [] for c in CONTENDERS}
    path = os.path.join(directory, "checkpoint_last.pt")
    for _ in range(repeats):
        for contender in CONTENDERS:
            if rank == 0:
                os.sync()
            dist.barrier()
            t0 = time.perf_counter()
            if contender.startswith("adam"):
                if rank == 0:
                    tmp = path + ".tmp"
                    with open(tmp, "wb") as f:
                        torch.save({"model": model, "last_optimizer_state": {"state": full, "param_groups": []}}, f)
                        if contender == "adam+fsync":
                            f.flush()
                            os.fsync(f.fileno())
                    os.replace(tmp, path)
            elif contender == "oss async":
                writer = CheckpointWriter(directory) if rank == 0 else None
                job = async_save.BackgroundSave(async_save.ShardSnapshot(opt, background), writer, parallel=True)
                if rank == 0:
                    opt.mark_state_pending()
                    obj = async_save.snapshot_tensors({"model": model, "last_optimizer_state": opt.state_dict()})
                    job.hand_off(obj, path)
                job.close_copies()
            else:
                writer = CheckpointWriter(directory) if rank == 0 else None
                opt.consolidate_state_dict(0, writer=writer, stream=True, parallel=contender == "oss parallel")
                if rank == 0:
                    writer.finish({"model": model, "last_optimizer_state": opt.state_dict()}, path)
            times[contender].append(time.perf_counter() - t0)
            if contender == "oss async":
                job.join()  # outside the timed window: training would go on meanwhile
                assert job.error is None, job.error
            dist.barrier()
    if rank == 0:
        out.put((times, os.path.getsize(path)))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, nargs="+", default=[35e6, 150e6])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    print(f"world size {args.world_size}, medians of {args.repeats} (min-max), seconds training is blocked")
    print(f"{'params':>8} {'file':>9} " + " ".join(f"{c:>20}" for c in CONTENDERS))
    ctx = mp.get_context("spawn")
    for numel in args.params:
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            out = ctx.Queue()
            procs = [ctx.Process(target=_worker, args=(r, args.world_size, port, int(numel), args.repeats, d, out))
                     for r in range(args.world_size)]
            for p in procs:
                p.start()
            times, size = out.get()
            for p in procs:
                p.join()
        cells = []
        for c in CONTENDERS:
            t = times[c]
            cells.append(f"{statistics.median(t):7.2f} ({min(t):.2f}-{max(t):.2f})")
        print(f"{numel / 1e6:>7.0f}M {size / 2**20:>7.0f}Mi " + " ".join(f"{c:>20}" for c in cells))


if __name__ == "__main__":
    main()

"""Run a function on N CPU processes joined by a gloo process group, inside pytest.

``run_ranks(world_size, fn, *args)`` spawns ``world_size`` processes, initializes
``torch.distributed`` (gloo, rendezvous through a file) in each, calls
``fn(rank, world_size, *args)`` and returns the list of the ranks' return values
(torch-saved, so tensors come back exactly). An exception on any rank fails the call
with that rank's traceback; a hang fails it after ``timeout`` seconds.
"""
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world_size, init_file, out_dir, fn, args):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(world_size, fn, *args, timeout=300):
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        ctx = mp.start_processes(
            _entry,
            args=(world_size, init_file, tmp, fn, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise AssertionError(f"ranks did not finish within {timeout} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            errors = []
            for r in range(world_size):
                path = os.path.join(tmp, f"{r}.pt")
                if os.path.exists(path):
                    res = torch.load(path, weights_only=False)
                    if "error" in res:
                        errors.append(f"rank {r}:\n{res['error']}")
            raise AssertionError("\n".join(errors) or "a rank failed") from None
        results = []
        for r in range(world_size):
            res = torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=False)
            results.append(res["ok"])
        return results

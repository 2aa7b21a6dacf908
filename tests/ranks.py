"""Run a function on N CPU processes joined by a gloo process group, inside pytest.

``run_ranks(world_size, fn, *args)`` calls ``fn(rank, world_size, *args)`` on every rank
of a pool of ``world_size`` worker processes and returns the ranks' return values in rank
order (torch-saved, so tensors come back exactly). ``fn`` must be a module-level function.

Workers are started once per world size and kept for the session (``shutdown_pools`` at
the end): starting a process that imports torch and fairseq costs seconds, a job does not.
An exception on any rank fails the call with that rank's traceback; a rank that does not
answer within ``timeout`` seconds (a hung collective) fails it too, and the pool is
replaced, since its process group can no longer be trusted. Once a rank has failed, the
others get ``FAILED_GRACE`` seconds more (they may sit in a collective the failed rank never
joins), and the failure names the failed rank's traceback either way.
"""
import io
import os
import queue
import tempfile
import traceback

import torch
import torch.multiprocessing as mp

_POOLS = {}
# Seconds the other ranks get to answer once one rank has failed.
FAILED_GRACE = 20


def _worker(rank, world_size, init_file, jobs, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args = job
        try:
            buf = io.BytesIO()
            torch.save({"ok": fn(rank, world_size, *args)}, buf)
        except BaseException:
            buf = io.BytesIO()
            torch.save({"error": traceback.format_exc()}, buf)
        results.put((rank, buf.getvalue()))
    dist.destroy_process_group()


class _Pool:
    def __init__(self, world_size):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tmp = tempfile.TemporaryDirectory()
        init_file = os.path.join(self.tmp.name, "rendezvous")
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, self.jobs[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, args, timeout):
        for q in self.jobs:
            q.put((fn, args))
        out = {}
        while len(out) < self.world_size:
            failed = [r for r, res in sorted(out.items()) if "error" in res]
            wait = min(timeout, FAILED_GRACE) if failed else timeout
            try:
                rank, data = self.results.get(timeout=wait)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                after = f" after rank(s) {failed} failed" if failed else ""
                raise AssertionError(
                    f"{fn.__name__}: ranks {sorted(set(range(self.world_size)) - set(out))} did not "
                    f"answer within {wait} s{after} (dead: {dead})" + _errors(out)
                ) from None
            out[rank] = torch.load(io.BytesIO(data), weights_only=False)
        if any("error" in res for res in out.values()):
            raise AssertionError(f"{fn.__name__} failed" + _errors(out))
        return [out[r]["ok"] for r in range(self.world_size)]

    def close(self, graceful=True):
        if graceful:
            for q in self.jobs:
                q.put(None)
            for p in self.procs:
                p.join(10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
        self.tmp.cleanup()


def _errors(out) -> str:
    """The failed ranks' tracebacks, each after a line naming the rank."""
    return "".join(f"\nrank {r}:\n{res['error']}" for r, res in sorted(out.items()) if "error" in res)


def run_ranks(world_size, fn, *args, timeout=300):
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        return pool.run(fn, args, timeout)
    except AssertionError as e:
        if "did not answer" in str(e) or "failed" in str(e):
            # A rank may still sit in a collective that the failed one never joined.
            _POOLS.pop(world_size).close(graceful=False)
        raise


def shutdown_pools():
    while _POOLS:
        _POOLS.popitem()[1].close()

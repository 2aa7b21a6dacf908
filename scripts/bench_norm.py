"""The gradient norm's cost on one rank: ``squared_norm`` (float32 norms of 4096-element
runs, squares summed in float64; what ``total_norm`` takes) against one float64 norm and
one float32 norm of the whole shard, interleaved (A B C A B C ...), median over repeats,
with each one's relative error from the exact float64 sum of squares.

Each is timed twice: with the allocator's memory warm, and with the heap handed back to
the system before each call (glibc's ``malloc_trim(0)``), as it is between the updates of
a training process that frees large buffers. A float64 norm of float32 elements makes a
float64 copy of them (twice their bytes), and that copy then pays a page fault per page.

    python scripts/bench_norm.py [--numel 2700000] [--repeats 41]

The default size is one rank's shard of the bench model's gradient at 2 ranks (5.4M
parameters, scripts/bench_comm.py). Single-threaded, as the tests' ranks run.
"""

import argparse
import ctypes
import ctypes.util
import statistics
import time

import torch

from fairseq_oss.optim.grad_reduction import NORM_CHUNK, squared_norm


def contenders():
    """Name to function; the first is the one the others are compared with."""
    return {
        f"squared_norm (float32 runs of {NORM_CHUNK}, float64 sum)": squared_norm,
        "one float64 norm": lambda t: torch.linalg.vector_norm(t, 2, dtype=torch.float64) ** 2,
        "one float32 norm": lambda t: torch.linalg.vector_norm(t, 2, dtype=torch.float32).double() ** 2,
    }


def heap_trimmer():
    """glibc's ``malloc_trim(0)``, or None where the C library has none."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=2_700_000)
    ap.add_argument("--repeats", type=int, default=41)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t = torch.randn(args.numel, generator=torch.Generator().manual_seed(0)) * 1e-3
    exact = t.double().square().sum().item()
    fns = contenders()
    trim = heap_trimmer()
    modes = ["warm", "trimmed"] if trim else ["warm"]
    times = {(name, m): [] for name in fns for m in modes}
    for m in modes:  # one mode after the other: a trim also empties the warm one's heap
        for _ in range(args.repeats):
            for name, fn in fns.items():
                if m == "trimmed":
                    trim(0)
                start = time.perf_counter()
                fn(t)
                times[(name, m)].append(time.perf_counter() - start)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    base = next(iter(fns))
    print(f"{args.numel:,} float32 elements, {args.repeats} interleaved repeats, 1 thread")
    if not trim:
        print("(no malloc_trim in this C library: warm figures only)")
    head = " | ".join(f"ms {m} (x squared_norm)" for m in modes)
    print(f"| norm | {head} | relative error of the sum of squares |")
    print("|---" * (len(modes) + 2) + "|")
    for name, fn in fns.items():
        cells = " | ".join(f"{med[(name, m)]:.2f} ({med[(name, m)] / med[(base, m)]:.1f}x)" for m in modes)
        err = abs(fn(t).item() - exact) / exact
        print(f"| {name} | {cells} | {err:.1e} |")


if __name__ == "__main__":
    main()

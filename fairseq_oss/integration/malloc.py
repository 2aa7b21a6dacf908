"""glibc's malloc told to keep the memory that an update frees, for oss_adam's
reduce-scatter on CPU.

Owns one process-wide setting, and why it is made. glibc's malloc gives the top of its heap
back to the kernel whenever more than its *trim threshold* is free there (a threshold it
adapts as it goes, to tens of MB in a fairseq-train rank), and the next allocation there
faults every page in again, one 4 KiB page at a time. The reduce-scatter frees each
gradient as soon as its bucket has taken it (ZeRO-2), and its staging buffers when the
reduction is done, so at the end of every backward the whole top of the heap is free: glibc
gives it back, and the next forward and backward fault it in again. Counted with
``strace`` and ``getrusage`` on scripts/bench_comm.py's model at 2 ranks: the heap shrank by
46 to 65 MB after every backward, and a rank's update took 361 to 14,928 minor page faults
(medians, in 7 of 8 rank-runs), in forward and backward; plain adam, whose gradients live
until the next update, kept its heap and took 2 to 7 in most runs. Now 4 to 6. On GPUs
PyTorch's caching allocator keeps freed memory; this does the same for the CPU heap:

* the trim threshold is set to ``INT_MAX`` (mallopt takes an int): the heap's top is given
  back only when 2 GiB are free there;
* the mmap threshold is set to 32 MiB, the highest that glibc's own adaptation reaches on
  64-bit (setting the trim threshold stops that adaptation, so it is fixed here rather
  than left wherever it stood): smaller allocations come from the heap and are reused,
  larger ones are mapped and unmapped each time, as before (so the reduction's own staging
  is cut into tensors of one rank's slice each: :mod:`fairseq_oss.optim.grad_reduction`).

Resident memory between updates then stays at what the update used, instead of falling
back after it; its peak stays about the same. A user who sets any ``glibc.malloc`` tunable
in ``GLIBC_TUNABLES`` keeps their own settings: nothing is changed then.
"""
import ctypes
import logging
import os
from typing import Optional

logger = logging.getLogger(__name__)

# <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 2**31 - 1
# glibc's DEFAULT_MMAP_THRESHOLD_MAX: 4 MiB per byte of a long (32 MiB on 64-bit).
MMAP_THRESHOLD = 4 * 2**20 * ctypes.sizeof(ctypes.c_long)

_outcome: Optional[str] = None  # what keep_freed_memory did in this process, once done


def glibc_version() -> Optional[str]:
    """``"2.36"`` where this process runs on glibc, else None."""
    try:
        name = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):
        return None
    return name.split()[1] if name.startswith("glibc ") else None


def keep_freed_memory() -> str:
    """Set glibc's trim and mmap thresholds as the module docstring says, once per process;
    what was done, in words (also logged, once): "kept" and the settings, or why nothing
    was changed (not glibc, the user's own ``GLIBC_TUNABLES``, mallopt refused)."""
    global _outcome
    if _outcome is not None:
        return _outcome
    version = glibc_version()
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if version is None:
        _outcome = "unchanged: not glibc"
    elif "glibc.malloc." in tunables:
        _outcome = f"unchanged: GLIBC_TUNABLES sets malloc's own ({tunables})"
    else:
        mallopt = ctypes.CDLL(None).mallopt
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD):
            _outcome = (
                f"kept: trim threshold {TRIM_THRESHOLD / 2**30:.0f} GiB, mmap threshold "
                f"{MMAP_THRESHOLD // 2**20} MiB, glibc {version}"
            )
        else:
            _outcome = f"unchanged: glibc {version}'s mallopt refused the thresholds"
    if _outcome.startswith("kept"):
        logger.info(
            "oss_adam on CPU: glibc's malloc keeps the memory an update frees for the next one (%s); "
            "the reduce-scatter frees gradients during backward (fairseq_oss/integration/malloc.py)",
            _outcome[len("kept: "):],
        )
    else:
        logger.log(
            logging.WARNING if "refused" in _outcome else logging.INFO,
            "oss_adam on CPU: glibc's malloc settings %s (fairseq_oss/integration/malloc.py)", _outcome,
        )
    return _outcome

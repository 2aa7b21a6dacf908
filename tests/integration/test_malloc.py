"""glibc's malloc keeps what an update frees, for oss_adam's reduce-scatter on CPU
(fairseq_oss/integration/malloc.py): counted as the minor page faults of allocations that
repeat, in a fresh Python process each (the setting is process-wide)."""
import subprocess
import sys

import pytest

from fairseq_oss.integration import malloc

pytestmark = pytest.mark.skipif(malloc.glibc_version() is None, reason="glibc's malloc only")

# An "update": 16 tensors of 4 MiB written and freed, as a backward's gradients are; the
# first update faults its pages in, the next two are counted.
UPDATES = r"""
import resource, sys
import torch
from fairseq_oss.integration import malloc

if sys.argv[1] == "keep":
    first = malloc.keep_freed_memory()
    assert malloc.keep_freed_memory() == first  # once per process
    print(first)

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def update():
    tensors = [torch.ones(2**20) for _ in range(16)]
    del tensors

update()
before = faults()
update()
update()
print(faults() - before)
"""
PAGES = 2 * 16 * 4 * 2**20 // 4096  # written in the two counted updates


def updates(how, env_extra=None):
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    proc = subprocess.run([sys.executable, "-c", UPDATES, how], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    *said, faults = proc.stdout.split()
    return " ".join(said), int(faults)


def test_memory_an_update_frees_is_reused_not_faulted_in_again():
    said, kept = updates("keep")
    assert said.startswith("kept: trim threshold 2 GiB, mmap threshold 32 MiB")
    _, default = updates("default")
    assert kept < PAGES // 10, (kept, PAGES)
    # glibc's defaults give the freed memory back: the same allocations fault again
    assert default > PAGES // 3, (default, PAGES)


def test_the_users_own_glibc_tunables_are_left_alone():
    said, faults = updates("keep", {"GLIBC_TUNABLES": "glibc.malloc.perturb=0"})
    assert said == "unchanged: GLIBC_TUNABLES sets malloc's own (glibc.malloc.perturb=0)"
    assert faults > PAGES // 3, (faults, PAGES)

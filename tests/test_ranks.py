"""tests/ranks.py itself: a rank that fails is reported with its traceback, also when the
other ranks are left waiting in a collective it never joins."""
import pytest
import torch.distributed as dist

import ranks
from ranks import run_ranks


def _rank0_raises_the_others_wait(rank, world_size):
    if rank == 0:
        raise ValueError("rank 0 gave up before the barrier")
    dist.barrier()  # never completes: rank 0 does not join it
    return rank


def test_a_failed_rank_is_reported_with_its_traceback_while_the_others_wait(monkeypatch):
    monkeypatch.setattr(ranks, "FAILED_GRACE", 2)
    with pytest.raises(AssertionError) as failure:
        run_ranks(2, _rank0_raises_the_others_wait, timeout=120)
    text = str(failure.value)
    assert "ranks [1] did not answer within 2 s after rank(s) [0] failed" in text
    assert "ValueError: rank 0 gave up before the barrier" in text
    assert 2 not in ranks._POOLS  # the pool, stuck in the barrier, was replaced

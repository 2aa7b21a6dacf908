"""fairseq_oss/optim/collectives.py at 2 and 3 ranks: no deprecated collective, and a gather
that waits for a stopped rank says which one it waits for."""
import logging
import os
import re
import time
import warnings

import pytest
import torch

from ranks import run_ranks


def _gathers_without_warnings(rank, world_size):
    from fairseq_oss.optim import collectives

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ints = collectives.all_gather_ints(rank * 10, None)
        bucket = torch.zeros(world_size * 4)
        shard = bucket[rank * 4 : (rank + 1) * 4].fill_(rank + 1)
        collectives.wait(collectives.all_gather_bucket(bucket, shard, None, world_size))
    return ints, bucket.tolist(), [str(w.message) for w in caught if "all_gather" in str(w.message)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gathers_raise_no_deprecation_warning(world_size):
    for ints, bucket, caught in run_ranks(world_size, _gathers_without_warnings):
        assert ints == [10 * r for r in range(world_size)]
        assert bucket == [float(r + 1) for r in range(world_size) for _ in range(4)]
        assert caught == []


def _gather_with_a_slow_rank(rank, world_size, slow_rank, flag):
    """The slow rank joins the gather only once rank 0 has reported waiting for it alone
    (rank 0 writes ``flag`` then), however late the others arrive on a loaded machine."""
    from fairseq_oss.optim import collectives

    collectives.AWAIT_LOG_SECONDS = 0.3
    records = []

    def emit(record):
        records.append(record.getMessage())
        if f"still waiting for rank(s) [{slow_rank}] " in records[-1]:
            open(flag, "w").close()

    handler = logging.Handler()
    handler.emit = emit
    collectives.logger.addHandler(handler)
    try:
        ranges = [(r * 3, (r + 1) * 3) for r in range(world_size)]
        if rank == slow_rank:  # as a rank stopped with SIGSTOP, then continued
            deadline = time.monotonic() + 120
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.05)
        out = collectives.gather_shards(torch.full((3,), float(rank)), ranges, 0, None, torch.empty(3 * world_size))
    finally:
        collectives.logger.removeHandler(handler)
        collectives.AWAIT_LOG_SECONDS = float(os.environ.get("FAIRSEQ_OSS_AWAIT_LOG_SECONDS", "60"))
    return None if out is None else out.tolist(), records


def _waited_for(message):
    return [int(r) for r in re.search(r"still waiting for rank\(s\) \[([\d, ]+)\]", message).group(1).split(",")]


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_gather_waiting_for_a_stopped_rank_names_it(world_size, tmp_path):
    slow = world_size - 1
    results = run_ranks(world_size, _gather_with_a_slow_rank, slow, str(tmp_path / "reported"))
    out, records = results[0]
    assert out == [float(r) for r in range(world_size) for _ in range(3)]
    # Every report names the stopped rank; the others, if late, only until they arrive.
    assert records and all(slow in _waited_for(m) for m in records)
    assert _waited_for(records[-1]) == [slow]
    assert all(r[1] == [] for r in results[1:])  # only the recipient waits for others

"""fairseq's ``--fp16`` layout, sharded (``tests/fp16_master.py``), on 2 and 3 CPU ranks
with gloo, against fairseq's fp16 adam computed by hand on every rank."""
import pytest
import torch

from fp16_master import master_job
from ranks import run_ranks


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("exchange", ["p2p", "all_gather"])
def test_fp16_model_over_a_flat_master_steps_as_fairseqs_fp16_adam(world_size, exchange):
    """Bit for bit (the p2p reduction sums in the reference's order), every fp16
    parameter on every rank after every step; the master in each rank's own shards; no
    rank keeps a full gradient, fp16 or fp32; the optimizer takes fp32 shards."""
    for r in run_ranks(world_size, master_job, "p2p", exchange):
        assert all(all(eq) for eq in r["equal"]), r["equal"]
        assert r["master_shards_equal"]
        assert all(r["master_grad"])
        assert r["dtypes"] == {"torch.float32"}
        for held in r["held"]:
            # the fp32 copies of its shards only: twice a 1/N fp16 share, up to padding
            assert held["grads"] == 0 and held["staging"] == 0
            assert held["shards"] <= 2 * (r["total_bytes"] / world_size + 2 * r["buckets"])


def test_fp16_reduce_scatter_collective_gives_the_same_parameters_within_rounding():
    """NCCL's path (``reduce_scatter_tensor`` in fp16, the all-gather of fp16), run on gloo."""
    results = run_ranks(3, master_job, "reduce_scatter", "all_gather")
    for r in results:
        assert all(r["master_grad"]) and r["dtypes"] == {"torch.float32"}
        # gloo sums in its own order: an fp16 gradient's last bit, which Adam may turn into
        # a step of its own (measured: 1.2e-4 at most, parameters of order 0.1-1)
        for got, want in zip(r["params"], r["ref"]):
            assert (got.float() - want.float()).abs().max().item() <= 5e-4
        for got, want in zip(results[0]["params"], r["params"]):
            assert torch.equal(got, want)  # every rank holds the same model

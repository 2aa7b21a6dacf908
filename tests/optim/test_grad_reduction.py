"""GradReducer: gradients reduce-scattered into each rank's shard during backward, on 2,
3 and 4 CPU ranks with gloo, against the same gradients summed by hand.

Each rank trains the tests' small model on its own inputs, with two micro-batches per
update (the first under ``no_sync``), real backward passes (the hooks fire as autograd
produces the gradients) and a layer that some ranks, or all ranks, leave unused in some
updates. The reference is computed on every rank: each rank's gradients, pre-divided by N
and summed in rank order (what the point-to-point reduction does), fed to fairseq's Adam.
"""
import pytest
import torch

from models import SMALL_BUCKET, lr_at, make_model, param_groups
from ranks import run_ranks

STEPS = 6


def _inputs(rank, step, micro):
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    return torch.randint(0, 300, (5,), generator=g), torch.randn(5, 3, generator=g)


def _uses_sometimes(rank, step):
    """Rank 0 skips the layer in odd steps; every rank skips it in step 4."""
    return step != 4 and not (rank == 0 and step % 2)


def _loss(model, rank, step, micro):
    idx, w = _inputs(rank, step, micro)
    h = model["fc2"](torch.relu(model["fc1"](model["embed"](idx))))
    if _uses_sometimes(rank, step):
        return (model["sometimes"](h) * w).sum()
    return (h[:, :3] * w).sum()


def _reference_grads(model, world_size, step, unused):
    """Every rank's accumulated gradients, times 1/N, summed in rank order."""
    total = {}
    for r in range(world_size):
        model.zero_grad(set_to_none=True)
        for micro in range(2):
            _loss(model, r, step, micro).backward()
        for n, p in model.named_parameters():
            if p.grad is None:
                continue
            g = torch.mul(p.grad, 1.0 / world_size)
            total[n] = g if n not in total else total[n] + g
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.grad = total.get(n, torch.zeros_like(p) if unused == "zero" else None)


class _Switch:
    enabled = True

    def __call__(self):
        return self.enabled


def reduce_job(rank, world_size, method, unused, cpu_run=None):
    from fairseq.optim.adam import Adam

    from fairseq_oss.optim import sharded_adam
    from fairseq_oss.optim.grad_reduction import GradReducer, total_norm
    from fairseq_oss.optim.sharded_adam import ShardedAdam

    if cpu_run is not None:
        sharded_adam.CPU_RUN = cpu_run

    model, ref = make_model(), make_model()
    opt = ShardedAdam(param_groups(model, 1e-3), betas=(0.9, 0.98), eps=1e-6, bucket_bytes=SMALL_BUCKET)
    ref_opt = Adam(param_groups(ref, 1e-3), betas=(0.9, 0.98), eps=1e-6)
    switch = _Switch()
    reducer = GradReducer(opt, method=method, unused=unused, sync_in_backward=switch)
    grad_bytes = sum(p.numel() * p.element_size() for p in opt.params)
    out = {"held": [], "before": [], "norms": [], "grads_left": 0, "early": 0, "buckets": len(opt.partition.buckets),
           "largest_staging": 0, "largest_shard": max(b.shard_numel for b in opt.partition.buckets),
           "largest_bucket": max(b.numel for b in opt.partition.buckets)}
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        reducer.reset()
        for micro in range(2):
            switch.enabled = micro == 1  # fairseq's no_sync for all micro-batches but the last
            _loss(model, rank, step, micro).backward()
        out["early"] += reducer._next  # parts (p2p: slices; else buckets) started during backward, before finish
        out["before"].append(reducer.held_bytes())
        out["largest_staging"] = max([out["largest_staging"]] + [  # (a tuple of tensors, or one)
            t.numel() for bufs in reducer._staging.values() for staging, _ in bufs
            for t in (staging if isinstance(staging, tuple) else (staging,))])
        reducer.finish()
        out["grads_left"] += sum(p.grad is not None for p in opt.params)
        out["held"].append(reducer.held_bytes())
        shards = opt.reduced_grads()
        norm = total_norm(shards, None, opt.params)
        _reference_grads(ref, world_size, step, unused)
        ref_norm = torch.norm(torch.stack([p.grad.norm() for p in ref.parameters() if p.grad is not None]))
        out["norms"].append((norm.item(), ref_norm.item()))
        for o in (opt, ref_opt):
            for group in o.param_groups:
                group["lr"] = lr_at(step) * (0.5 if group.get("weight_decay") else 1.0)
        opt.step()
        ref_opt.step()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["ref"] = {n: p.detach().clone() for n, p in ref.named_parameters()}
    out["steps"] = list(opt.steps)
    out["ref_steps"] = [ref_opt.state[p]["step"] if p in ref_opt.state else 0
                        for g in ref_opt.param_groups for p in g["params"]]
    out["grad_bytes"] = grad_bytes
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("unused", ["skip", "zero"])
def test_point_to_point_reduction_steps_as_adam_on_the_summed_gradients(world_size, unused):
    """Bit for bit: the p2p reduction sums in the reference's order; parameters that no
    rank used are not stepped ("skip", PyTorch's DDP) or stepped with zeros ("zero",
    fairseq's legacy DDP), exactly as fairseq's Adam does with those gradients."""
    results = run_ranks(world_size, reduce_job, "p2p", unused)
    for r in results:
        for n, t in r["ref"].items():
            assert torch.equal(r["params"][n], t), n
        assert r["steps"] == r["ref_steps"]
        assert r["grads_left"] == 0  # no rank keeps a full .grad after the reduction
        assert r["early"] > 0  # some parts left during backward, not at finish
        for got, want in r["norms"]:
            assert abs(got - want) <= 1e-6 * want
    skipped = [s for s in results[0]["steps"] if 0 < s < STEPS]  # 0: the frozen layer
    assert (len(skipped) > 0) == (unused == "skip")  # step 4: "sometimes" unused everywhere
    assert all(torch.equal(results[0]["params"][n], r["params"][n]) for r in results for n in r["params"])


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_adam_on_a_reduced_shard_in_short_runs_gives_the_same_bits(world_size):
    """The step takes a reduced shard through Adam a run of CPU_RUN elements at a time:
    with runs of 7 elements, most cut a parameter's piece in two or end inside one, and
    the unused layer leaves gaps between runs; the parameters still equal fairseq's Adam's
    bit for bit."""
    results = run_ranks(world_size, reduce_job, "p2p", "skip", 7)
    for r in results:
        for n, t in r["ref"].items():
            assert torch.equal(r["params"][n], t), n
        assert r["steps"] == r["ref_steps"]
    assert max(results[0]["steps"]) == STEPS and min(s for s in results[0]["steps"] if s) < STEPS  # a gap


@pytest.mark.parametrize("world_size", [2, 3])
def test_gradients_held_after_the_reduction_are_one_shard_and_the_buffers(world_size):
    """What a rank keeps once the reduction is done: its shards (total/N, up to one padding
    element per bucket), no ``.grad`` tensor, no staging buffer. During backward, staging
    for two buckets at most (each with room for the other ranks' slices of its shard)."""
    for r in run_ranks(world_size, reduce_job, "p2p", "skip"):
        total, buckets = r["grad_bytes"], r["buckets"]
        for held in r["held"]:
            assert held == {"shards": held["shards"], "staging": 0, "grads": 0}
            assert held["shards"] <= total / world_size + 4 * buckets
        for before in r["before"]:
            assert before["staging"] <= 2 * (2 * SMALL_BUCKET + 4 * world_size)
        # where backward started buckets (not where an unused layer holds them all back)
        assert any(b["staging"] > 0 and b["grads"] < total for b in r["before"])
        # point to point, no tensor of the staging is larger than one rank's slice of a bucket
        # (under glibc's mmap threshold from 2 ranks on: reused on CPU, not mapped afresh)
        assert 0 < r["largest_staging"] <= r["largest_shard"] < r["largest_bucket"]


def test_reduce_scatter_collective_gives_the_same_parameters_within_rounding():
    """NCCL's path (``reduce_scatter_tensor``), run on gloo: its sum order is gloo's."""
    for r in run_ranks(3, reduce_job, "reduce_scatter", "skip"):
        assert r["largest_staging"] >= r["largest_bucket"]  # one tensor: reduce_scatter_tensor takes it whole
        for n, t in r["ref"].items():
            assert torch.allclose(r["params"][n], t, rtol=1e-5, atol=1e-7), n
        assert r["steps"] == r["ref_steps"] and r["grads_left"] == 0


def _linear_stack(layers):
    """``layers`` equal ``Linear(16, 16)``, the same weights on every rank."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)])


def _linear_inputs(rank):
    return torch.randn(3, 16, generator=torch.Generator().manual_seed(rank))


def _shards_exact(opt, rank, world_size, layers):
    """For each of ``opt``'s buckets, whether this rank's reduced shard equals every rank's
    gradients of ``_linear_stack(layers)`` on its inputs, times 1/N, summed in rank order
    (the buckets lay the parameters end to end)."""
    ref = _linear_stack(layers)
    total = None
    for r in range(world_size):
        ref.zero_grad(set_to_none=True)
        ref(_linear_inputs(r)).sum().backward()
        flat = torch.cat([torch.mul(p.grad, 1.0 / world_size).reshape(-1) for p in ref.parameters()])
        total = flat if total is None else total + flat
    exact, offset = [], 0
    for b, shard in zip(opt.partition.buckets, opt.reduced_grads()):
        lo, hi = b.shard_range(rank)
        exact.append(torch.equal(shard, total[offset + lo : offset + hi]))
        offset += b.numel
    return exact


def slices_job(rank, world_size):
    """Four equal layers in one bucket; what has been sent when backward reaches the first."""
    from fairseq_oss.optim.grad_reduction import GradReducer
    from fairseq_oss.optim.sharded_adam import ShardedAdam

    model = _linear_stack(4)
    opt = ShardedAdam(model.parameters(), bucket_bytes=1 << 20)
    reducer = None
    seen = []  # parts started when each of the first layer's gradients arrives
    for p in model[0].parameters():  # registered first: runs before the reducer's hook
        p.register_post_accumulate_grad_hook(lambda p: seen.append(reducer._next))
    reducer = GradReducer(opt, method="p2p")
    model(_linear_inputs(rank)).sum().backward()
    reducer.finish()
    return {
        "buckets": len(opt.partition.buckets),
        "seen": seen,
        "parts": len(reducer._parts),
        "shard_equal": all(_shards_exact(opt, rank, world_size, 4)),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_bucket_goes_to_its_owners_slice_by_slice_during_backward(world_size):
    """One bucket holds the whole model: the slices owned by ranks 1..N-1 (the last layers,
    whose gradients backward gives first) are sent while backward still computes the first
    layer, each rank's shard is the exact sum, and one message per peer is all it takes."""
    for r in run_ranks(world_size, slices_job):
        assert r["buckets"] == 1 and r["parts"] == world_size
        assert min(r["seen"]) == world_size - 1  # all but slice 0, which holds the first layer
        assert r["shard_equal"]


def ahead_job(rank, world_size, flag):
    """Rank 0 runs backward alone until it has started its second bucket; the other ranks
    start theirs only then (they wait for the flag it writes)."""
    import os
    import time

    from fairseq_oss.optim.grad_reduction import GradReducer
    from fairseq_oss.optim.sharded_adam import ShardedAdam

    model = _linear_stack(4)
    opt = ShardedAdam(model.parameters(), bucket_bytes=272 * 4)  # a layer's size: 4 or 5 buckets
    reducer = GradReducer(opt, method="p2p")
    start, started = reducer._start, []

    def spy(u):
        start(u)
        if reducer._parts[u].first:
            started.append(reducer._parts[u].bucket)
            if rank == 0 and len(started) == 2:
                open(flag, "w").close()

    reducer._start = spy
    if rank != 0:
        deadline = time.monotonic() + 60
        while not os.path.exists(flag):
            if time.monotonic() > deadline:
                raise TimeoutError("rank 0 did not start its second bucket while the others waited")
            time.sleep(0.01)
    model(_linear_inputs(rank)).sum().backward()
    reducer.finish()
    return {"buckets": len(opt.partition.buckets), "started": started,
            "shards_equal": _shards_exact(opt, rank, world_size, 4)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_backward_goes_on_while_its_last_two_buckets_are_on_their_way(world_size, tmp_path):
    """A rank starts a bucket without waiting for the one before it (only for the one before
    that, whose staging buffer it takes): rank 0 gives its last layer's bucket and starts the
    next one before any other rank has started its backward; the sums are exact."""
    flag = str(tmp_path / "rank0-started-two-buckets")
    for r in run_ranks(world_size, ahead_job, flag, timeout=120):
        assert r["buckets"] >= 3 and r["started"] == list(range(r["buckets"] - 1, -1, -1))
        assert all(r["shards_equal"])


def abandoned_job(rank, world_size):
    """A reduction that backward began is reset before it is finished (fairseq's recovery
    from running out of memory in the middle of backward): refused, and nothing changed."""
    from fairseq_oss.optim.grad_reduction import GradReducer
    from fairseq_oss.optim.sharded_adam import ShardedAdam

    model = _linear_stack(3)
    opt = ShardedAdam(model.parameters(), bucket_bytes=272 * 4)
    reducer = GradReducer(opt, method="p2p")
    reducer.reset()  # before any backward: nothing to refuse
    model(_linear_inputs(rank)).sum().backward()
    started = reducer._next
    try:
        reducer.reset()
        refused = None
    except RuntimeError as e:
        refused = str(e)
    reducer.finish()  # the reduction is still whole: every rank completes it
    exact = _shards_exact(opt, rank, world_size, 3)
    reducer.reset()  # once finished, fairseq's zero_grad goes through
    return {"started": started, "parts": len(reducer._parts), "refused": refused, "exact": exact}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_reduction_abandoned_by_backward_is_refused_not_left_hanging(world_size):
    """fairseq's zero_grad after backward began the reduction raises, naming the cause (a
    rank that went on would restart the reduction its peers are finishing: a hang)."""
    for r in run_ranks(world_size, abandoned_job):
        assert r["started"] == r["parts"] > 0
        assert r["refused"] is not None and "out of memory in the middle of backward" in r["refused"]
        assert f"{r['parts']} of {r['parts']} parts" in r["refused"]
        assert all(r["exact"])  # refusing changed nothing: the reduction then completes, exact


@pytest.mark.parametrize("numel", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5, 1_000_000 + 4001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_squared_norm_is_the_float64_sum_of_squares_to_float32_rounding(numel, dtype):
    """The norm's squares, chunk by chunk in float32 and summed in float64: every element
    counted once (chunk boundaries, the remainder), within a few float32 roundings of the
    exact float64 sum (one float32 norm of the million elements is off by about 2e-5), for
    fp32 shards and --memory-efficient-fp16's fp16 ones."""
    from fairseq_oss.optim.grad_reduction import squared_norm

    t = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3).to(dtype)
    want = t.double().square().sum()
    got = squared_norm(t)
    assert got.dtype == torch.float64
    # (a run of 4096 or the remainder dropped is off by far more than 1e-6 of the sum; at the
    # small sizes, so is one element)
    assert abs(got.item() - want.item()) <= 1e-6 * want.item()


def test_squared_norm_keeps_inf_and_nan():
    """fp16's overflow check and fairseq's non-finite gradient norm read inf and nan
    through the norm, wherever in a shard they are."""
    from fairseq_oss.optim.grad_reduction import squared_norm

    t = torch.ones(3 * 4096 + 7)
    for i in (0, 4096, 3 * 4096 + 6):
        u = t.clone()
        u[i] = float("inf")
        assert squared_norm(u).item() == float("inf")
        u[i] = float("nan")
        assert squared_norm(u).isnan()

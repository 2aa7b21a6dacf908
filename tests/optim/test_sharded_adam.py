"""ShardedAdam against fairseq's Adam, on 1, 2 and 3 CPU ranks with gloo.

Assumption these tests rely on: data parallelism gives every rank the same gradients, so
feeding every rank (and the reference) the same gradients is exactly what fairseq does
after its all-reduce. Parity is checked on parameters and state, bit for bit.
"""
import copy
import math
import os

import pytest
import torch

from checks import assert_same_state_dict
from models import SMALL_BUCKET, build, lr_at, make_model, run_steps
from ranks import run_ranks

WORLD_SIZES = [1, 2, 3]
def parity_job(rank, world_size, bucket_bytes, exchange):
    from fairseq_oss.optim import collectives

    model, opt, ref, ref_opt = build(bucket_bytes, exchange)
    gathers = []
    name = {"p2p": "exchange_pieces", "all_gather": "all_gather_bucket"}[opt.exchange]
    original = getattr(collectives, name)

    def counting(*args):
        gathers.append(1)
        return original(*args)

    setattr(collectives, name, counting)
    run_steps(model, opt, 1, 1)
    setattr(collectives, name, original)
    run_steps(ref, ref_opt, 1, 1)
    run_steps(model, opt, 2, 20, scale=0.5)
    run_steps(ref, ref_opt, 2, 20, scale=0.5)
    opt.consolidate_state_dict(recipient_rank=0)
    sd = opt.state_dict() if rank == 0 else None
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "ref_params": {n: p.detach().clone() for n, p in ref.named_parameters()},
        "state_dict": sd,
        "ref_state_dict": ref_opt.state_dict(),
        "state_bytes": opt.state_bytes(),
        "buckets": len(opt.partition.buckets),
        "gathers_per_step": len(gathers),
        "num_params": len(opt._params),
        "exchange": opt.exchange,
    }


@pytest.mark.parametrize("exchange", [None, "all_gather"], ids=["default-exchange", "all-gather"])
@pytest.mark.parametrize("bucket_bytes", [SMALL_BUCKET, 32 * 2**20], ids=["small-buckets", "default-bucket"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bitwise_parity_with_fairseq_adam(world_size, bucket_bytes, exchange):
    """20 updates with two param groups, weight decay, a warm-up/decay schedule,
    clipped gradients, a parameter without gradient in steps 3-5 and a frozen one: the
    parameters on every rank and the consolidated state equal fairseq's Adam bit for bit,
    with either exchange of the step (gloo's default is point to point; NCCL's default,
    the all-gather, is forced here to test it on CPU)."""
    results = run_ranks(world_size, parity_job, bucket_bytes, exchange)
    assert results[0]["exchange"] == (exchange or "p2p")  # the tests run on gloo
    for rank, res in enumerate(results):
        for name, want in res["ref_params"].items():
            assert torch.equal(res["params"][name], want), (rank, name)
    ref_sd = results[0]["ref_state_dict"]
    # the reference skipped the frozen parameter and counted only 17 steps for "sometimes"
    assert ref_sd["state"][6]["step"] == 17 and 8 not in ref_sd["state"]
    assert_same_state_dict(results[0]["state_dict"], ref_sd)

    # Sharded, not replicated: the ranks' state adds up to plain Adam's, each holds ~1/N.
    total = sum(2 * t.numel() * 4 for t in results[0]["params"].values())
    per_rank = [r["state_bytes"] for r in results]
    assert sum(per_rank) == total
    assert max(per_rank) <= total / world_size + 2 * 4 * results[0]["buckets"]
    # One exchange (all-gather, or set of point-to-point messages) per bucket.
    if world_size > 1:
        assert results[0]["gathers_per_step"] == results[0]["buckets"]
    if bucket_bytes > SMALL_BUCKET:
        assert results[0]["buckets"] < results[0]["num_params"]


def save_job(rank, world_size, path, bucket_bytes):
    model, opt, ref, ref_opt = build(bucket_bytes)
    run_steps(model, opt, 1, 10)
    run_steps(ref, ref_opt, 1, 10)
    opt.consolidate_state_dict()
    if rank == 0:
        torch.save(
            {
                "optimizer": opt.state_dict(),
                "model": model.state_dict(),
                "ref_optimizer": ref_opt.state_dict(),
                "ref_model": ref.state_dict(),
            },
            path,
        )
    return None


def resume_job(rank, world_size, path, bucket_bytes):
    model, opt, ref, ref_opt = build(bucket_bytes)
    ckpt = torch.load(path, weights_only=False)
    model.load_state_dict(ckpt["model"])
    ref.load_state_dict(ckpt["ref_model"])
    opt.load_state_dict(ckpt["optimizer"])
    ref_opt.load_state_dict(ckpt["ref_optimizer"])
    run_steps(model, opt, 11, 15)
    run_steps(ref, ref_opt, 11, 15)
    opt.consolidate_state_dict()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "ref_params": {n: p.detach().clone() for n, p in ref.named_parameters()},
        "state_dict": opt.state_dict() if rank == 0 else None,
        "ref_state_dict": ref_opt.state_dict(),
    }


@pytest.mark.parametrize("save_ws, load_ws", [(2, 1), (2, 3), (1, 2), (3, 2), (3, 3)])
def test_resume_at_another_world_size(tmp_path, save_ws, load_ws):
    """State saved at N (in the plain format) and loaded at M continues exactly as plain
    Adam saved and loaded the same way. Different bucket sizes on each side too: the file
    does not depend on the layout."""
    path = os.path.join(tmp_path, "ckpt.pt")
    run_ranks(save_ws, save_job, path, SMALL_BUCKET)
    saved = torch.load(path, weights_only=False)
    assert_same_state_dict(saved["optimizer"], saved["ref_optimizer"])
    results = run_ranks(load_ws, resume_job, path, 2048)
    for rank, res in enumerate(results):
        for name, want in res["ref_params"].items():
            assert torch.equal(res["params"][name], want), (rank, name)
    assert_same_state_dict(results[0]["state_dict"], results[0]["ref_state_dict"])


# ---------------------------------------------------------------- single process


def test_load_accepts_tensor_steps():
    """torch.optim.Adam stores step as a tensor."""
    model, opt, ref, ref_opt = build(SMALL_BUCKET)
    run_steps(ref, ref_opt, 1, 3)
    sd = copy.deepcopy(ref_opt.state_dict())
    for entry in sd["state"].values():
        entry["step"] = torch.tensor(float(entry["step"]))
    opt.load_state_dict(sd)
    assert_same_state_dict(opt.state_dict(), ref_opt.state_dict())


def _mutate(kind, sd):
    if kind == "groups":
        sd["param_groups"] = sd["param_groups"][:1]
    elif kind == "count":
        sd["param_groups"][1]["params"] = sd["param_groups"][1]["params"][:-1]
    elif kind == "shape":
        sd["state"][1]["exp_avg"] = torch.zeros(16, 9)
    elif kind == "missing":
        del sd["state"][3]["exp_avg_sq"]
    elif kind == "dtype":
        sd["state"][4]["exp_avg"] = sd["state"][4]["exp_avg"].double()
    return sd


@pytest.mark.parametrize(
    "kind, message",
    [
        ("groups", "1 param groups, this optimizer has 2"),
        ("count", "param group 1: loaded state has 7 parameters, this optimizer has 8"),
        ("shape", r"parameter 1: loaded state exp_avg has shape \(16, 9\), the parameter has shape \(16, 8\)"),
        ("missing", "parameter 3: loaded state has no 'exp_avg_sq'"),
        ("dtype", "parameter 4: loaded state exp_avg has dtype torch.float64, this optimizer keeps torch.float32"),
    ],
)
def test_load_rejects_a_mismatch_and_names_it(kind, message):
    model, opt, ref, ref_opt = build(SMALL_BUCKET)
    run_steps(ref, ref_opt, 1, 2)
    sd = _mutate(kind, copy.deepcopy(ref_opt.state_dict()))
    before = [t.clone() for t in opt._exp_avg]
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(before, opt._exp_avg))  # nothing half-loaded


def test_load_does_not_modify_the_callers_dict():
    model, opt, ref, ref_opt = build(SMALL_BUCKET)
    run_steps(ref, ref_opt, 1, 2)
    sd = ref_opt.state_dict()
    snapshot = copy.deepcopy(sd)
    opt.load_state_dict(sd)
    assert_same_state_dict(sd, snapshot)


def state_dict_without_consolidation_job(rank, world_size):
    model, opt, _, _ = build(SMALL_BUCKET)
    run_steps(model, opt, 1, 1)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        opt.state_dict()
    return True


def test_state_dict_without_consolidation_raises():
    assert run_ranks(2, state_dict_without_consolidation_job) == [True, True]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"amsgrad": True}, ValueError, "amsgrad"),
        ({"bucket_bytes": 0}, ValueError, "bucket_bytes"),
        ({"exchange": "ring"}, ValueError, "exchange must be 'p2p' or 'all_gather', got 'ring'"),
    ],
)
def test_constructor_rejects(kwargs, error, message):
    from fairseq_oss.optim.sharded_adam import ShardedAdam

    with pytest.raises(error, match=message):
        ShardedAdam(make_model().parameters(), **kwargs)


def test_non_contiguous_parameter_is_rejected():
    from fairseq_oss.optim.sharded_adam import ShardedAdam

    p = torch.nn.Parameter(torch.zeros(4, 3).t())
    with pytest.raises(ValueError, match="contiguous"):
        ShardedAdam([p])


def test_add_param_group_after_construction_is_refused():
    model, opt, _, _ = build(SMALL_BUCKET)
    with pytest.raises(NotImplementedError):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


def test_lr_schedule_is_read_from_the_groups_each_step():
    """fairseq's LR schedulers set group['lr'] before each step; a changed lr must apply."""
    assert not math.isclose(lr_at(3), lr_at(10))
    model, opt, ref, ref_opt = build(SMALL_BUCKET)
    run_steps(model, opt, 1, 6)
    run_steps(ref, ref_opt, 1, 6)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n


def flat_and_bf16_job(rank, world_size):
    """The two layouts fairseq's fp16 wrappers hand an optimizer: FP16Optimizer's single
    flat fp32 master tensor, and MemoryEfficientFP16Optimizer's low-precision params
    (updated in fp32, written back)."""
    from fairseq.optim.adam import Adam

    from fairseq_oss.optim.sharded_adam import ShardedAdam

    out = {}
    for name, dtype, numel in (("flat-fp32", torch.float32, 10007), ("bf16", torch.bfloat16, 999)):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(numel).to(dtype))
        q = torch.nn.Parameter(p.detach().clone())
        opt = ShardedAdam([p], lr=1e-2, weight_decay=0.1, bucket_bytes=4096)
        ref = Adam([q], lr=1e-2, weight_decay=0.1)
        for step in range(1, 21):
            g = torch.randn(numel, generator=torch.Generator().manual_seed(step)).to(dtype)
            p.grad, q.grad = g.clone(), g.clone()
            opt.step()
            ref.step()
        opt.consolidate_state_dict()
        out[name] = (p.detach().clone(), q.detach().clone(), opt.state_dict() if rank == 0 else None,
                     ref.state_dict(), opt.state_bytes())
    return out


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_flat_master_and_bf16_params(world_size):
    results = run_ranks(world_size, flat_and_bf16_job)
    for rank, res in enumerate(results):
        for name, (p, q, _, _, _) in res.items():
            assert p.dtype == q.dtype and torch.equal(p, q), (rank, name)
    for name, (p, _, sd, ref_sd, _) in results[0].items():
        assert_same_state_dict(sd, ref_sd)
        assert sd["state"][0]["exp_avg"].dtype == torch.float32  # fp32 state for bf16 params
        per_rank = [r[name][4] for r in results]
        assert sum(per_rank) == 2 * 4 * p.numel()
        assert max(per_rank) <= 1.01 * 2 * 4 * p.numel() / world_size


def test_too_many_buckets_are_refused_before_anything_is_allocated():
    from fairseq_oss.optim.sharded_adam import ShardedAdam, TooManyBuckets

    p = torch.nn.Parameter(torch.zeros(1000))
    with pytest.raises(TooManyBuckets) as e:
        ShardedAdam([p], bucket_bytes=4, max_buckets=999)
    assert e.value.count == 1000 and e.value.total_bytes == 4000
    assert len(ShardedAdam([p], bucket_bytes=4, max_buckets=1000).partition.buckets) == 1000

"""No rank reads a stale parameter when ShardedAdam's step returns with its exchange in
flight (``defer_exchange``): on 1, 2 and 3 CPU ranks with gloo, through both exchanges.

Each read comes right after a step that rank 0 takes before the other ranks have taken
theirs (they wait for it on a second process group, then step), so when rank 0 reads,
its parameters' other pieces have not been waited for (asserted) and may not have been
sent yet. Every read must see what fairseq's Adam, stepped on the same gradients, holds:
a forward through :class:`ReadGuard` in which a module reads a child's weight without
calling the child (as fairseq's MultiheadAttention does) and another reads its own
weight where no torch function sees it (as a C++ extension may), a child module called outside
that forward, ``state_dict()`` (a save right after the step), ``load_state_dict()``
(what it loads is not overwritten afterwards by pieces still arriving), a deep copy
of the model (fairseq's EMA), a pickle of its parameters (``torch.save``), and reads
outside any module (``p.data``, ``.numpy()``, ``.tolist()``, indexing, ``torch.eq``),
while reads of metadata (``p.grad = None``, ``p.shape``) wait for nothing.
"""
import copy
import io
import time
import types

import pytest
import torch
import torch.nn.functional as F

from models import SMALL_BUCKET, build, run_steps
from ranks import run_ranks


class Reader(torch.nn.Module):
    """The tests' model with a forward that reads every parameter: fc1's weight
    functionally, the other layers by calling them."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx):
        m = self.model
        h = torch.relu(F.linear(m["embed"](idx), m["fc1"].weight, m["fc1"].bias))
        return m["frozen"](m["sometimes"](m["fc2"](h)))


def _unseen_linear(self, x):
    """fc2's forward as a C++ extension reads its weight: out of the mode's sight."""
    with torch._C.DisableTorchFunction():
        return torch.nn.functional.linear(x, self.weight, self.bias)


def _inputs():
    return torch.arange(0, 300, 7)


def _step_before_the_others(rank, model, opt, ref, ref_opt, step, side):
    import torch.distributed as dist

    if rank != 0:
        dist.barrier(group=side)
        time.sleep(0.2)  # rank 0 reads meanwhile: any read that does not wait is stale
    run_steps(model, opt, step, step)
    run_steps(ref, ref_opt, step, step)
    if rank == 0:
        dist.barrier(group=side)
    return sorted(opt.param_exchange.unread)


def reads_job(rank, world_size, exchange, bucket_bytes):
    import torch.distributed as dist

    from fairseq_oss.optim.param_reads import ReadGuard, install_read_hooks

    side = dist.new_group(backend="gloo")  # its barrier does not queue behind an all-gather
    model, opt, ref, ref_opt = build(bucket_bytes, exchange)
    opt.defer_exchange = True
    model["fc2"].forward = types.MethodType(_unseen_linear, model["fc2"])
    reader, ref_reader = Reader(model), Reader(ref)
    guard = ReadGuard(lambda: opt.param_exchange)
    install_read_hooks(reader, guard)
    # Steps with nothing read between them: each step waits for the previous one's exchange.
    run_steps(model, opt, 1, 4)
    run_steps(ref, ref_opt, 1, 4)
    out = {"unread": [], "exchange": opt.exchange, "depth_after_steps": _mode_depth()}  # one watch, not four

    out["unread"].append(_step_before_the_others(rank, model, opt, ref, ref_opt, 5, side))
    with torch.no_grad():
        out["forward"] = (guard.forward(reader, _inputs()), ref_reader(_inputs()))
    out["unread_after_forward"] = sorted(opt.param_exchange.unread)

    out["unread"].append(_step_before_the_others(rank, model, opt, ref, ref_opt, 6, side))
    x = torch.randn(7, 16, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        out["child"] = (model["fc2"](x), ref["fc2"](x))

    out["unread"].append(_step_before_the_others(rank, model, opt, ref, ref_opt, 7, side))
    out["state_dict"] = ({k: v.clone() for k, v in reader.state_dict().items()},
                         {k: v.clone() for k, v in ref_reader.state_dict().items()})

    out["unread"].append(_step_before_the_others(rank, model, opt, ref, ref_opt, 8, side))
    copied = copy.deepcopy(reader)  # as fairseq builds its EMA
    out["deepcopy"] = ({k: v.detach().clone() for k, v in copied.named_parameters()},
                       {k: v.detach().clone() for k, v in ref_reader.named_parameters()})

    out["unread"].append(_step_before_the_others(rank, model, opt, ref, ref_opt, 9, side))
    buf = io.BytesIO()
    torch.save(dict(reader.named_parameters()), buf)  # the Parameters themselves, pickled
    buf.seek(0)
    out["pickled"] = ({k: v.detach().clone() for k, v in torch.load(buf, weights_only=True).items()},
                      {k: v.detach().clone() for k, v in ref_reader.named_parameters()})

    earlier = {k: v.clone() for k, v in reader.state_dict().items()}
    out["unread"].append(_step_before_the_others(rank, model, opt, ref, ref_opt, 10, side))
    reader.load_state_dict(earlier)
    opt.param_exchange.wait_all()  # anything still arriving would land now
    out["loaded"] = ({k: v.clone() for k, v in reader.state_dict().items()}, earlier)
    ref_reader.load_state_dict(earlier)  # the twins alike again, for the steps below

    # Reads outside any module, by code of the user's own, one way per step: the step's
    # watch makes them wait.
    out["outside"], out["outside_faced"] = {}, {}
    for step, way in enumerate(OUTSIDE_READS, start=11):
        out["unread"].append(_step_before_the_others(rank, model, opt, ref, ref_opt, step, side))
        out["depth_after_step"] = _mode_depth()
        faced, got = [], {}
        for k, p in reader.named_parameters():
            faced.append(opt.param_exchange.index_of(p) in opt.param_exchange.unread)
            got[k] = OUTSIDE_READS[way](p)
        out["outside"][way] = (got, {k: v.detach().clone() for k, v in ref_reader.named_parameters()})
        out["outside_faced"][way] = any(faced)

    # Reads of metadata only wait for nothing (fairseq's zero_grad right after the step).
    _step_before_the_others(rank, model, opt, ref, ref_opt, 16, side)
    before = sorted(opt.param_exchange.unread)
    for p in reader.parameters():
        p.grad = None
        _ = (p.shape, p.dtype, p.device, p.requires_grad, p.is_leaf, p.size(), p.numel(), p.dim(), p.grad, len(p))
    out["metadata_unread"] = (before, sorted(opt.param_exchange.unread))
    with torch.no_grad():
        guard.forward(reader, _inputs())
    out["depth_after_forward"] = _mode_depth()  # everything arrived: the watch is gone

    # A step inside a mode of the user's, whose exit would pop whatever is on top: no
    # watch pushed above it, everything waited for instead (all ranks step together).
    with PassThrough():
        run_steps(model, opt, 17, 17)
        run_steps(ref, ref_opt, 17, 17)
        out["inside_mode"] = (sorted(opt.param_exchange.unread), _mode_depth())
    out["depth_after_outer"] = _mode_depth()
    out["after_outer"] = ({k: v.clone() for k, v in reader.state_dict().items()},
                          {k: v.clone() for k, v in ref_reader.state_dict().items()})

    dist.destroy_process_group(side)
    return out


class PassThrough(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _mode_depth():
    return len(torch.overrides._get_current_function_mode_stack())


OUTSIDE_READS = {
    "data": lambda p: p.data.clone(),
    "numpy": lambda p: torch.from_numpy(p.detach().numpy().copy()),
    "tolist": lambda p: torch.tensor(p.tolist(), dtype=p.dtype),
    "index": lambda p: torch.stack([p[i].detach().clone() for i in range(len(p))]),
    "equal": lambda p: torch.where(torch.eq(p, p.detach().clone()), p.detach(), torch.nan),
}


def _assert_equal(pair, what):
    got, want = pair
    if isinstance(want, dict):
        assert got.keys() == want.keys(), what
        for k in want:
            assert torch.equal(got[k], want[k]), (what, k)
    else:
        assert torch.equal(got, want), what


# The all-gather reuses two gather buffers: a step over more than two buckets of a kind
# waits for the first ones' all-gathers, which the other ranks join only in their own step.
# So rank 0 can step ahead of them with one bucket per kind only (the default size).
@pytest.mark.parametrize("exchange, bucket_bytes", [(None, SMALL_BUCKET), ("all_gather", 32 * 2**20)],
                         ids=["default-exchange", "all-gather"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_no_read_right_after_a_deferred_step_is_stale(world_size, exchange, bucket_bytes):
    results = run_ranks(world_size, reads_job, exchange, bucket_bytes, timeout=120)
    assert results[0]["exchange"] == (exchange or "p2p")
    for rank, res in enumerate(results):
        for what in ("forward", "child", "state_dict", "loaded", "deepcopy", "pickled", "after_outer"):
            _assert_equal(res[what], (rank, what))
        for way in OUTSIDE_READS:
            _assert_equal(res["outside"][way], (rank, way))
        # Metadata reads waited for nothing; the watch was on the stack after the step
        # (with something in flight) and gone after the forward.
        before, after = res["metadata_unread"]
        assert before == after and bool(before) == (world_size > 1)
        watched = int(world_size > 1)  # nothing in flight at one rank: no watch
        assert (res["depth_after_steps"], res["depth_after_step"], res["depth_after_forward"]) == (watched, watched, 0)
        assert (res["inside_mode"], res["depth_after_outer"]) == (([], 1), 0)
    # Each read did come with pieces not waited for yet (none at one rank: nothing to exchange).
    for unread in results[0]["unread"]:
        assert bool(unread) == (world_size > 1)
    # Each way of reading outside a module met a parameter with pieces still in flight.
    assert results[0]["outside_faced"] == {way: world_size > 1 for way in OUTSIDE_READS}
    # The forward waited for what it read, all of it here (fc1 through F.linear included).
    assert results[0]["unread_after_forward"] == []

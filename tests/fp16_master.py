"""fairseq's ``--fp16`` layout, sharded: an fp16 model, one flat fp32 master copy of its
trainable parameters that the optimizer steps. :func:`master_job` runs on every rank of a
process group: ``tests/optim/test_fp16_master.py`` on 2 and 3 CPU ranks with gloo,
``scripts/cuda_check.py`` on a GPU with NCCL.

The reducer is built over the fp16 parameters in the master's layout and the optimizer
exchanges the fp16 parameters (``ShardedAdam.exchange_into``). The reference is what
fairseq's FP16Optimizer does with adam, computed on every rank: each rank's fp16
gradients times 1/N, summed in rank order in fp16, copied into the master's fp32
gradient (zeros where a parameter has none), fairseq's Adam on the master, and the whole
master copied into the fp16 model.
"""
import torch

from models import SMALL_BUCKET, lr_at, make_model

STEPS = 5


def _loss(model, rank, step):
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank)
    idx, w = torch.randint(0, 300, (5,), generator=g), torch.randn(5, 3, generator=g).half()
    device = model["fc1"].weight.device
    idx, w = idx.to(device), w.to(device)
    h = model["fc2"](torch.relu(model["fc1"](model["embed"](idx))))
    if step != 3 and not (rank == 0 and step % 2):  # rank 0 skips "sometimes" in odd steps, all in step 3
        return (model["sometimes"](h) * w).float().sum()
    return (h[:, :3] * w).float().sum()


def _flat_master(params):
    master = torch.nn.Parameter(torch.cat([p.detach().reshape(-1).float() for p in params]))
    return master, [[(i, p.numel()) for i, p in enumerate(params)]]


def master_job(rank, world_size, method, exchange, device="cpu"):
    """Also run by scripts/cuda_check.py on a GPU (NCCL, world size 1)."""
    from fairseq.optim.adam import Adam

    from fairseq_oss.optim.grad_reduction import GradReducer
    from fairseq_oss.optim.sharded_adam import ShardedAdam

    model, ref = make_model().half().to(device), make_model().half().to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    ref_params = [p for p in ref.parameters() if p.requires_grad]
    master, layout = _flat_master(params)
    ref_master, _ = _flat_master(ref_params)
    hyper = dict(betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    opt = ShardedAdam([master], lr=1e-3, bucket_bytes=SMALL_BUCKET, exchange=exchange, defer_exchange=True, **hyper)
    ref_opt = Adam([ref_master], lr=1e-3, **hyper)
    opt.exchange_into(params, layout)
    reducer = GradReducer(opt, method=method, unused="zero", sources=params, layout=layout)
    out = {"equal": [], "master_grad": [], "held": [], "dtypes": set()}
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        reducer.reset()
        _loss(model, rank, step).backward()
        reducer.finish()
        out["master_grad"].append(master.grad is None and all(p.grad is None for p in params))
        out["held"].append(reducer.held_bytes())
        out["dtypes"].update(str(s.dtype) for s in opt.reduced_grads())
        # the reference: every rank's gradients, as fairseq's DDP and FP16Optimizer sum them
        total = [None] * len(ref_params)
        for r in range(world_size):
            ref.zero_grad(set_to_none=True)
            _loss(ref, r, step).backward()
            for i, p in enumerate(ref_params):
                if p.grad is not None:
                    g = torch.mul(p.grad, 1.0 / world_size)
                    total[i] = g if total[i] is None else total[i] + g
        ref_master.grad = torch.cat(
            [(t if t is not None else torch.zeros_like(p)).reshape(-1).float() for t, p in zip(total, ref_params)]
        )
        for o in (opt, ref_opt):
            o.param_groups[0]["lr"] = lr_at(step)
        opt.step()
        ref_opt.step()
        with torch.no_grad():
            offset = 0
            for p in ref_params:
                p.copy_(ref_master[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        opt.param_exchange.wait_all()  # what the next forward's reads wait for
        out["equal"].append([torch.equal(p, q) for p, q in zip(params, ref_params)])
    # The master is up to date in this rank's shards: compare those elements.
    mine = [(b.shard_range(rank), b) for b in opt.partition.buckets]
    out["master_shards_equal"] = all(
        torch.equal(master.data[pc.param_offset : pc.param_offset + pc.numel],
                    ref_master.data[pc.param_offset : pc.param_offset + pc.numel])
        for (start, end), b in mine for pc in b.shard_pieces(rank)
    )
    out["params"] = [p.detach().clone() for p in params]
    out["ref"] = [p.detach().clone() for p in ref_params]
    out["total_bytes"] = sum(p.numel() for p in params) * 2
    out["buckets"] = len(opt.partition.buckets)
    return out

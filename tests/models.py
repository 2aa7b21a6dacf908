"""A small model, its param groups and a deterministic training loop for the optimizer and
checkpoint tests: :func:`build` makes a model with ShardedAdam and its twin with
fairseq's Adam, whose parameters must stay bitwise equal.
"""
import torch

SMALL_BUCKET = 512  # bytes: 128 fp32 elements, so parameters span buckets


def make_model():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {
            "embed": torch.nn.Embedding(300, 8),
            "fc1": torch.nn.Linear(8, 16),
            "fc2": torch.nn.Linear(16, 4),
            "sometimes": torch.nn.Linear(4, 3),  # no gradient in some steps
            "frozen": torch.nn.Linear(3, 3),  # requires_grad=False: never a gradient
        }
    )
    model["frozen"].requires_grad_(False)
    return model


def param_groups(model, lr):
    """Two groups with their own lr and weight decay, as a fairseq user may build."""
    return [
        {"params": list(model["embed"].parameters()), "lr": lr},
        {
            "params": [p for n, p in model.named_parameters() if not n.startswith("embed")],
            "lr": lr,
            "weight_decay": 0.01,
        },
    ]


def lr_at(step):
    """Polynomial-decay-with-warm-up shaped schedule, set on the groups each step."""
    warmup, total, peak = 4, 30, 1e-2
    if step <= warmup:
        return peak * step / warmup
    return peak * (1 - (step - warmup) / (total - warmup)) ** 1.0


def set_grads(model, step):
    """The same gradients on every rank, as after fairseq's all-reduce."""
    g = torch.Generator().manual_seed(1000 + step)
    for name, p in model.named_parameters():
        no_grad = name.startswith("frozen") or (name.startswith("sometimes") and 3 <= step <= 5)
        p.grad = None if no_grad else torch.randn(p.shape, generator=g)


def run_steps(model, opt, first, last, scale=1.0):
    for step in range(first, last + 1):
        set_grads(model, step)
        if scale != 1.0:  # what --clip-norm does to the gradients before the step
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        for group in opt.param_groups:
            group["lr"] = lr_at(step) * (0.5 if group.get("weight_decay") else 1.0)
        opt.step()


def build(bucket_bytes, exchange=None):
    from fairseq.optim.adam import Adam

    from fairseq_oss.optim.sharded_adam import ShardedAdam

    model, ref = make_model(), make_model()
    opt = ShardedAdam(param_groups(model, 1e-3), betas=(0.9, 0.98), eps=1e-6, bucket_bytes=bucket_bytes,
                      exchange=exchange)
    ref_opt = Adam(param_groups(ref, 1e-3), betas=(0.9, 0.98), eps=1e-6)
    return model, opt, ref, ref_opt

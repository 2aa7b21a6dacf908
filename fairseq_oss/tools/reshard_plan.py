"""``fairseq-oss reshard-plan FILE --world-size M [--bucket-mb B]``: what each of M ranks
would hold and read when ``oss_adam`` resumes from FILE, from the index alone (nothing
is loaded): the answer to "will it fit on M GPUs"."""
from fairseq_oss.optim import bucket_size
from fairseq_oss.checkpoint.format import CheckpointError
from fairseq_oss.checkpoint.index import CheckpointIndex
from fairseq_oss.optim.partition import ParamSpec, bucket_count, partition
from fairseq_oss.tools.report import human_bytes, print_table

STATE_KEYS = ("exp_avg", "exp_avg_sq")
BUCKET_FLAG = "--bucket-mb"


def plan(index: CheckpointIndex, world_size: int, bucket_mb: float) -> dict:
    """What each of ``world_size`` ranks holds and reads. Raises CheckpointError for a
    file without optimizer state, ValueError for an unusable ``bucket_mb``."""
    bucket_bytes = bucket_size.bucket_bytes(bucket_mb, BUCKET_FLAG)
    obj = index.obj if isinstance(index.obj, dict) else {}
    state = obj.get("last_optimizer_state")
    if not isinstance(state, dict) or "param_groups" not in state:
        raise CheckpointError(f"{index.path}: holds no optimizer state (stripped, or saved without it): "
                              "resuming it builds a fresh one")
    entries = state.get("state") or {}
    specs, unknown, itemsize = [], 0, 4
    for g, group in enumerate(state["param_groups"]):
        for pid in group.get("params", []):
            entry = entries.get(pid)
            if not isinstance(entry, dict) or "exp_avg" not in entry:
                unknown += 1  # never stepped: its size is not in the checkpoint
                continue
            t = entry["exp_avg"]
            itemsize = t.element_size()
            specs.append(ParamSpec(g, t.numel(), str(t.dtype)))
    bucket_numel = max(1, bucket_bytes // itemsize)
    bucket_size.check_bucket_count(bucket_count(specs, world_size, bucket_numel),
                                   sum(s.numel for s in specs) * itemsize, bucket_mb, BUCKET_FLAG)
    layout = partition(specs, world_size, bucket_numel)
    model = index.records_of(obj.get("model") or {})
    model_bytes = sum(r.nbytes for r in model.values())
    ema_bytes = sum(r.nbytes for name, r in _ema_records(index, obj).items() if name not in model)
    ranks = []
    for r in range(world_size):
        state_bytes = layout.shard_numel(r) * itemsize * len(STATE_KEYS)
        ranks.append({"rank": r, "adam_state_bytes": state_bytes, "reads_at_resume_bytes": state_bytes,
                      "model_bytes": model_bytes, "ema_bytes": ema_bytes,
                      "total_bytes": state_bytes + model_bytes + ema_bytes})
    shares = [x["adam_state_bytes"] for x in ranks]
    mean = sum(shares) / len(shares)
    return {"file": index.path, "world_size": world_size, "bucket_bytes": bucket_bytes,
            "buckets": len(layout.buckets), "parameters_with_state": len(specs),
            "parameters_without_state": unknown, "ranks": ranks,
            "balance": (max(shares) / mean) if mean else 1.0,
            "full_adam_state_bytes": sum(shares)}


def _ema_records(index: CheckpointIndex, obj: dict) -> dict:
    """The records of fairseq's EMA model and its float32 copies (``--store-ema``,
    ``--ema-fp32``), which every rank restores and holds when it resumes."""
    extra = obj.get("extra_state") if isinstance(obj.get("extra_state"), dict) else {}
    records = {}
    for key in ("ema", "ema_fp32_params"):
        if isinstance(extra.get(key), dict):
            records.update(index.records_of(extra[key]))
    return records


def run(args) -> int:
    if args.world_size < 1:
        raise CheckpointError(f"--world-size must be at least 1, got {args.world_size}")
    try:
        bucket_size.bucket_bytes(args.bucket_mb, BUCKET_FLAG)  # before the file is read
        p = plan(CheckpointIndex(args.file), args.world_size, args.bucket_mb)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    print(f"{p['file']}: resumed by oss_adam on {p['world_size']} rank(s), {p['buckets']} bucket(s) of "
          f"{human_bytes(p['bucket_bytes'])}")
    ema = any(x["ema_bytes"] for x in p["ranks"])
    print(f"  full Adam state {human_bytes(p['full_adam_state_bytes'])}; every rank also holds the model "
          f"{'and its EMA ' if ema else ''}(its weights as the file stores them: tied tensors once)")
    print_table([(x["rank"], human_bytes(x["adam_state_bytes"]), human_bytes(x["reads_at_resume_bytes"]),
                  human_bytes(x["model_bytes"]), *([human_bytes(x["ema_bytes"])] if ema else []),
                  human_bytes(x["total_bytes"])) for x in p["ranks"]],
                header=("rank", "Adam state", "reads at resume", "model weights", *(["EMA"] if ema else []), "total"),
                indent=2)
    print(f"  balance (largest / mean Adam state): {p['balance']:.4f}")
    if p["parameters_without_state"]:
        print(f"  {p['parameters_without_state']} parameter(s) have no state yet (never stepped): "
              "not counted; they add their size x 2 / {world} per rank once stepped".replace("{world}", str(args.world_size)))
    return 0

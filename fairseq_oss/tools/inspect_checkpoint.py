"""``fairseq-oss inspect FILE [--json]``: what a checkpoint holds, from its index only
(pickle, zip directory, manifest): constant memory whatever the file's size."""
import collections
import json

import torch

from fairseq_oss.checkpoint.index import CheckpointIndex
from fairseq_oss.tools.report import human_bytes, print_table

TOP = 5


def summarize(index: CheckpointIndex) -> dict:
    obj = index.obj if isinstance(index.obj, dict) else {}
    out = {"file": index.path, "file_bytes": index.size}
    out["model"] = _tensors_summary(index, obj.get("model"))
    extra = obj.get("extra_state") if isinstance(obj.get("extra_state"), dict) else {}
    if isinstance(extra.get("ema"), dict):  # --store-ema
        out["ema"] = _ema_summary(index, extra)
    if isinstance(obj.get("criterion"), dict) and any(True for _ in index.tensors(obj["criterion"])):
        out["criterion"] = _tensors_summary(index, obj["criterion"])  # a criterion with parameters
    out["optimizer"] = _optimizer_summary(index, obj)
    history = (obj.get("optimizer_history") or [{}])[-1]
    cfg = obj.get("cfg") if isinstance(obj.get("cfg"), dict) else {}
    args = obj.get("args")
    dt = cfg.get("distributed_training") or {}
    out["training"] = {
        "num_updates": history.get("num_updates"),
        "epoch": (extra.get("train_iterator") or {}).get("epoch"),
        "lr_scheduler_state": history.get("lr_scheduler_state"),
        "world_size": dt.get("distributed_world_size", getattr(args, "distributed_world_size", None)),
        "optimizer_config": (cfg.get("optimizer") or {}).get("_name", getattr(args, "optimizer", None)),
    }
    manifest = index.manifest
    out["written_by"] = manifest.get("writer", "fairseq-oss 0.1 (its manifest names no writer)") if manifest else "torch.save (stock fairseq or other)"
    out["checksums"] = (
        f"per 1 MiB chunk, {sum(len(r['crc32']) for r in manifest['records'].values())} chunks" if manifest
        else "none beyond the zip's own CRC32 per record"
    )
    return out


def _tensors_summary(index, tree) -> dict:
    if not isinstance(tree, dict):
        return {"tensors": 0}
    tensors = list(index.tensors(tree))
    # Counted by storage, as the file stores them: tied tensors (a shared embedding) once.
    records = index.records_of(tree)
    dtypes = collections.Counter()
    for record in records.values():
        dtypes[str(record.dtype).replace("torch.", "")] += record.nbytes
    largest = sorted(tensors, key=lambda nt: -nt[1].numel())[:TOP]
    return {
        "tensors": len(tensors),
        "storages": len(records),
        "parameters": sum(r.nbytes // torch._utils._element_size(r.dtype) for r in records.values()),
        "bytes": sum(r.nbytes for r in records.values()),
        "bytes_by_dtype": dict(dtypes),
        "largest": [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")} for n, t in largest],
    }


def _ema_summary(index, extra) -> dict:
    """fairseq's EMA model (``--store-ema``), and its float32 copies (``--ema-fp32``): those
    add only the storages that the EMA's own tensors do not already hold (a float32 model's
    EMA is its own float32 copy)."""
    out = _tensors_summary(index, extra["ema"])
    copies = extra.get("ema_fp32_params")
    if isinstance(copies, dict):
        own = index.records_of(extra["ema"])
        more = [r for name, r in index.records_of(copies).items() if name not in own]
        out["fp32_copies"] = {"tensors": len(list(index.tensors(copies))), "bytes": sum(r.nbytes for r in more)}
    return out


def _optimizer_summary(index, obj) -> dict:
    history = (obj.get("optimizer_history") or [{}])[-1]
    state = obj.get("last_optimizer_state")
    out = {"name": history.get("optimizer_name")}
    if not isinstance(state, dict):
        out["state"] = "none (not saved, or stripped)"
        return out
    entries = state.get("state") or {}
    by_key = collections.Counter()
    steps = []
    for entry in entries.values():
        if not isinstance(entry, dict):
            continue
        for key, value in entry.items():
            if hasattr(value, "numel") and value.dim() > 0:
                by_key[key] += value.numel() * value.element_size()
            elif key == "step":
                steps.append(int(value.item()) if hasattr(value, "item") else int(value))
    out["entries"] = len(entries)
    out["bytes_by_key"] = dict(by_key)
    out["bytes"] = sum(by_key.values())
    out["step"] = (min(steps), max(steps)) if steps else None
    groups = state.get("param_groups") or []
    out["param_groups"] = [
        {k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, str, bool, tuple, list))}
        | {"params": len(g.get("params", []))}
        for g in groups
    ]
    if "loss_scale" in state:
        out["loss_scale"] = state["loss_scale"]
    return out


def run(args) -> int:
    summary = summarize(CheckpointIndex(args.file))
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    m, o, t = summary["model"], summary["optimizer"], summary["training"]
    print(f"{summary['file']}: {human_bytes(summary['file_bytes'])}")
    print(f"  written by:  {summary['written_by']}; checksums: {summary['checksums']}")
    print(f"  training:    {t['num_updates']} updates, epoch {t['epoch']}, world size {t['world_size']}, "
          f"optimizer {t['optimizer_config']}")
    print(f"  lr scheduler: {t['lr_scheduler_state']}")
    if m["tensors"]:
        dtypes = ", ".join(f"{k} {human_bytes(v)}" for k, v in m["bytes_by_dtype"].items())
        shared = m["tensors"] - m["storages"]
        tied = f" ({m['storages']} distinct: {shared} share storage)" if shared else ""
        print(f"  model:       {m['parameters']:,} values in {m['tensors']} tensors{tied}, "
              f"{human_bytes(m['bytes'])} ({dtypes})")
        print_table([(x["name"], "x".join(map(str, x["shape"])), x["dtype"]) for x in m["largest"]], indent=4,
                    header=("largest tensors", "shape", "dtype"))
    else:
        print("  model:       none")
    if "criterion" in summary:
        c = summary["criterion"]
        print(f"  criterion:   {c['parameters']:,} values in {c['tensors']} tensors, {human_bytes(c['bytes'])}")
    if "ema" in summary:
        e = summary["ema"]
        dtypes = ", ".join(f"{k} {human_bytes(v)}" for k, v in e["bytes_by_dtype"].items())
        line = (f"  ema:         {e['parameters']:,} values in {e['tensors']} tensors, "
                f"{human_bytes(e['bytes'])}" + (f" ({dtypes})" if dtypes else ""))
        if "fp32_copies" in e:
            c = e["fp32_copies"]
            line += f"; float32 copies (--ema-fp32): {c['tensors']} tensors, {human_bytes(c['bytes'])} more"
        print(line)
    if "entries" in o:
        keys = ", ".join(f"{k} {human_bytes(v)}" for k, v in o["bytes_by_key"].items())
        print(f"  optimizer:   {o['name']}, {o['entries']} entries, {human_bytes(o['bytes'])} ({keys}), "
              f"step {o['step'][0] if o['step'] and o['step'][0] == o['step'][1] else o['step']}")
        for g in o["param_groups"]:
            print(f"    group: {', '.join(f'{k}={v}' for k, v in g.items())}")
        if "loss_scale" in o:
            print(f"    loss scale: {o['loss_scale']}")
    else:
        print(f"  optimizer:   {o['name']}, {o['state']}")
    return 0

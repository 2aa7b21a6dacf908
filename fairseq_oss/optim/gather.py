"""The sharded Adam state gathered into memory on one rank: the ``torch.optim`` API.

Owns :meth:`ShardedAdam.consolidate_state_dict`'s gather (the plain state dict on one
rank, for in-memory use) and the reusable one-bucket buffers that every pass over the
state uses, this one and the checkpoint's. Tensors only, never pickles; no file I/O.
"""
from typing import Dict, Optional

import torch

from fairseq_oss.optim import collectives


def bucket_buffers(opt) -> Dict[str, torch.Tensor]:
    """One bucket of state per kind, like ``opt``'s shards (dtype, device), reused by
    every gather or scatter of a pass."""
    shards = opt.state_shards()[0][1]
    sizes, first = {}, {}
    for b in opt.partition.buckets:
        sizes[b.kind] = max(sizes.get(b.kind, 0), b.numel)
        first.setdefault(b.kind, b.index)
    return {kind: shards[first[kind]].new_empty(n) for kind, n in sizes.items()}


def gather_in_memory(opt, recipient_rank: int) -> Optional[Dict[int, Dict[str, torch.Tensor]]]:
    """The full state of every stepped parameter, shaped like it, on ``recipient_rank``
    (None elsewhere): one bucket at a time, point to point into one reused buffer.

    .. warning:: Collective: call on all ranks of ``opt.process_group``.
    """
    is_recipient = opt.rank == recipient_rank
    full: Dict[int, Dict[str, torch.Tensor]] = {}
    if is_recipient:
        for i, p in enumerate(opt.params):
            if opt.steps[i] > 0:
                dtype = opt.state_dtype(p.dtype)
                full[i] = {
                    "exp_avg": torch.empty(p.shape, dtype=dtype, device=p.device),
                    "exp_avg_sq": torch.empty(p.shape, dtype=dtype, device=p.device),
                }
    out = opt.state_bucket_buffers() if is_recipient else {}
    for b in opt.partition.buckets:
        for key, local in opt.state_shards():
            gathered = collectives.gather_shards(
                local[b.index], opt.shard_ranges(b), recipient_rank, opt.process_group, out.get(b.kind)
            )
            if is_recipient:
                for pc in b.pieces:
                    if pc.param in full:
                        full[pc.param][key].view(-1)[
                            pc.param_offset : pc.param_offset + pc.numel
                        ].copy_(gathered[pc.offset : pc.offset + pc.numel])
    return full if is_recipient else None

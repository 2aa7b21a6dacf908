"""``ShardedAdam``: fairseq's Adam with its state sharded across data-parallel ranks.

Owns the optimizer step and the mapping between the sharded state and the plain
``torch.optim`` state-dict format. The layout comes from :mod:`fairseq_oss.partition`;
the collectives live in :mod:`fairseq_oss.collectives`. It does not touch fairseq.

Numerics: each rank applies exactly the arithmetic of ``fairseq.optim.adam.Adam`` (the
optimizer ``--optimizer adam`` uses on CPU) to its shard, element by element, in the same
order; element-wise kernels give the same bits on a slice as on the whole tensor, so the
parameters equal plain Adam's bit for bit at any world size (``tests/test_sharded_adam.py``).

Every rank holds, besides the parameters, only:

* ``exp_avg`` and ``exp_avg_sq`` for its shard of each bucket (about 1/N of Adam's state);
* the step count of every parameter (one int each: parameters are stepped on every rank
  alike, since data parallelism gives all ranks the same set of gradients);
* two gather buffers of one bucket each, per dtype.
"""
import math
from typing import Dict, List, Optional, Tuple

import torch

from fairseq_oss import collectives
from fairseq_oss.partition import Bucket, ParamSpec, Partition, partition

_LOW_PRECISION = (torch.float16, torch.bfloat16)
DEFAULT_BUCKET_BYTES = 32 * 2**20


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Adam keeps fp32 state for fp16/bf16 parameters, as fairseq's Adam does."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


class ShardedAdam(torch.optim.Optimizer):
    """Adam (fairseq's variant: decoupled weight decay) with ZeRO stage 1 state sharding.

    Arguments:
        params: parameters or param groups, as for any ``torch.optim.Optimizer``.
        lr, betas, eps, weight_decay, amsgrad: as ``fairseq.optim.adam.Adam``.
        process_group: the data-parallel group to shard over; ``None`` means the default
            group if ``torch.distributed`` is initialized, else a single process.
        bucket_bytes: size of one gathered bucket. Collectives move one bucket at a time,
            so this bounds the extra memory of a step and of a consolidation.

    Raises:
        ValueError: for ``amsgrad=True`` (fairseq never enables it), a sparse or
            non-contiguous parameter, or a non-positive bucket size.

    .. warning:: The constructor, :meth:`step` and :meth:`consolidate_state_dict` are
        collective: call them on all ranks of ``process_group``, in the same order.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        process_group=None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ):
        if amsgrad:
            raise ValueError("ShardedAdam does not implement amsgrad")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        self._frozen_groups = False
        super().__init__(params, defaults)
        self._frozen_groups = True

        self.process_group = process_group
        self.world_size, self.rank = collectives.world_size_and_rank(process_group)
        self._params: List[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        for i, p in enumerate(self._params):
            if p.is_sparse or not p.is_contiguous():
                raise ValueError(f"parameter {i} ({tuple(p.shape)}) must be dense and contiguous")
        specs = [
            ParamSpec(g, p.numel(), f"{p.dtype}@{p.device}")
            for g, group in enumerate(self.param_groups)
            for p in group["params"]
        ]
        itemsize = max((p.element_size() for p in self._params), default=4)
        self.partition: Partition = partition(specs, self.world_size, max(1, bucket_bytes // itemsize))
        # For each parameter, the (bucket, piece) pairs of this rank's shards that hold it.
        self._param_shards = self.partition.param_shards(self.rank)
        self._steps: List[int] = [0] * len(self._params)
        # Adam state of this rank's shard of each bucket (flat, fp32 for fp16/bf16 params).
        self._exp_avg: List[torch.Tensor] = []
        self._exp_avg_sq: List[torch.Tensor] = []
        for b in self.partition.buckets:
            start, end = b.shard_range(self.rank)
            p0 = self._params[b.pieces[0].param]
            dtype = _state_dtype(p0.dtype)
            self._exp_avg.append(torch.zeros(end - start, dtype=dtype, device=p0.device))
            self._exp_avg_sq.append(torch.zeros(end - start, dtype=dtype, device=p0.device))
        self._gather_buffers: Dict[str, List[torch.Tensor]] = {}
        self._consolidated: Optional[Dict[int, Dict[str, torch.Tensor]]] = None

    # ------------------------------------------------------------------ layout helpers

    def add_param_group(self, param_group):
        if self._frozen_groups:
            raise NotImplementedError("ShardedAdam cannot add param groups after construction")
        super().add_param_group(param_group)

    def _flat(self, index: int) -> torch.Tensor:
        return self._params[index].data.view(-1)

    def _buffer(self, bucket: Bucket, slot: int) -> torch.Tensor:
        """One of two reusable gather buffers for the bucket's dtype and device."""
        buffers = self._gather_buffers.get(bucket.kind)
        if buffers is None:
            size = max(b.shard_numel for b in self.partition.buckets if b.kind == bucket.kind)
            p0 = self._params[bucket.pieces[0].param]
            # Two, so that one bucket is filled while the previous one is still in flight.
            buffers = [
                torch.empty(size * self.world_size, dtype=p0.dtype, device=p0.device)
                for _ in range(2)
            ]
            self._gather_buffers[bucket.kind] = buffers
        return buffers[slot % len(buffers)][: bucket.shard_numel * self.world_size]

    def state_bytes(self) -> int:
        """Bytes of Adam state (exp_avg and exp_avg_sq) held by this rank."""
        return sum(t.numel() * t.element_size() for t in self._exp_avg + self._exp_avg_sq)

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure=None):
        """Update this rank's shard of every parameter, then all-gather the buckets so
        that every rank holds the full updated parameters.

        .. warning:: Collective: call on all ranks.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for i, p in enumerate(self._params):
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise RuntimeError(
                        "Adam does not support sparse gradients, please consider SparseAdam instead"
                    )
                self._steps[i] += 1

        pending = None  # (bucket, buffer, work) of the gather in flight
        for b in self.partition.buckets:
            buf = self._buffer(b, b.index)
            c = b.shard_numel
            shard = buf[self.rank * c : (self.rank + 1) * c]
            self._update_shard(b, shard)
            work = collectives.all_gather_bucket(buf, shard, self.process_group, self.world_size)
            if pending is not None:
                self._unpack(*pending)
            pending = (b, buf, work)
        if pending is not None:
            self._unpack(*pending)
        return loss

    def _update_shard(self, bucket: Bucket, shard: torch.Tensor) -> None:
        """Copy this rank's part of the bucket's parameters into ``shard`` and apply Adam
        to it, run by run of pieces that share a step count and have a gradient."""
        pieces = bucket.shard_pieces(self.rank)
        if not pieces:
            return
        group = self.param_groups[bucket.group]
        exp_avg, exp_avg_sq = self._exp_avg[bucket.index], self._exp_avg_sq[bucket.index]
        grad = torch.empty_like(exp_avg)
        runs: List[List[int]] = []  # [start, end, step] of shard ranges to update
        for pc in pieces:
            lo, hi = pc.offset, pc.offset + pc.numel
            shard[lo:hi].copy_(self._flat(pc.param)[pc.param_offset : pc.param_offset + pc.numel])
            g = self._params[pc.param].grad
            if g is None:
                continue
            grad[lo:hi].copy_(g.view(-1)[pc.param_offset : pc.param_offset + pc.numel])
            step = self._steps[pc.param]
            if runs and runs[-1][1] == lo and runs[-1][2] == step:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi, step])
        for lo, hi, step in runs:
            p = shard[lo:hi]
            p_fp32 = p.float() if p.dtype in _LOW_PRECISION else p
            _adam_update(p_fp32, grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], step, group)
            if p_fp32 is not p:
                p.copy_(p_fp32)

    def _unpack(self, bucket: Bucket, buf: torch.Tensor, work) -> None:
        collectives.wait(work)
        for pc in bucket.pieces:
            self._flat(pc.param)[pc.param_offset : pc.param_offset + pc.numel].copy_(
                buf[pc.offset : pc.offset + pc.numel]
            )

    # ------------------------------------------------------------------ state dict

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Gather the full Adam state on ``recipient_rank`` (a rank of ``process_group``),
        bucket by bucket, as tensors; other ranks only send their shards.

        .. warning:: Collective: call on all ranks, before :meth:`state_dict` on the recipient.
        """
        self._consolidated = None
        if self.world_size == 1:
            return
        full: Dict[int, Dict[str, torch.Tensor]] = {}
        is_recipient = self.rank == recipient_rank
        if is_recipient:
            for i, p in enumerate(self._params):
                if self._steps[i] > 0:
                    dtype = _state_dtype(p.dtype)
                    full[i] = {
                        "exp_avg": torch.empty(p.shape, dtype=dtype, device=p.device),
                        "exp_avg_sq": torch.empty(p.shape, dtype=dtype, device=p.device),
                    }
        for b in self.partition.buckets:
            for key, local in (("exp_avg", self._exp_avg), ("exp_avg_sq", self._exp_avg_sq)):
                gathered = collectives.gather_shards(
                    local[b.index], b.shard_numel, recipient_rank, self.process_group, self.world_size
                )
                if is_recipient:
                    for pc in b.pieces:
                        if pc.param in full:
                            full[pc.param][key].view(-1)[
                                pc.param_offset : pc.param_offset + pc.numel
                            ].copy_(gathered[pc.offset : pc.offset + pc.numel])
        if is_recipient:
            self._consolidated = full

    def state_dict(self):
        """The state in the format of ``fairseq.optim.adam.Adam.state_dict()``: one entry
        per stepped parameter with ``step`` (int), ``exp_avg`` and ``exp_avg_sq`` shaped
        like the parameter, and one ``param_groups`` list.

        With several ranks, only the recipient of :meth:`consolidate_state_dict` can call
        this, once per consolidation (the gathered copy is handed over, not kept).

        Raises:
            RuntimeError: if the state was not consolidated on this rank.
        """
        if self.world_size == 1:
            full = self._local_full_state()
        else:
            if self._consolidated is None:
                raise RuntimeError(
                    "ShardedAdam.state_dict() on a sharded optimizer needs "
                    "consolidate_state_dict() to be called on all ranks first, and is only "
                    f"available on the recipient rank (this is rank {self.rank})"
                )
            full, self._consolidated = self._consolidated, None
        state = {
            i: {"step": self._steps[i], "exp_avg": t["exp_avg"], "exp_avg_sq": t["exp_avg_sq"]}
            for i, t in sorted(full.items())
        }
        return {"state": state, "param_groups": self._packed_param_groups()}

    def _packed_param_groups(self):
        groups, start = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        return groups

    def _local_full_state(self) -> Dict[int, Dict[str, torch.Tensor]]:
        """World size 1: the shards are the whole state; view them per parameter."""
        full = {}
        for i, p in enumerate(self._params):
            if self._steps[i] == 0:
                continue
            entry = {}
            for key, local in (("exp_avg", self._exp_avg), ("exp_avg_sq", self._exp_avg_sq)):
                parts = [
                    local[bi][pc.offset : pc.offset + pc.numel]
                    for bi, pc in self._param_shards.get(i, [])
                ]
                flat = parts[0] if len(parts) == 1 else torch.cat(parts)
                entry[key] = flat.clone().view(p.shape)
            full[i] = entry
        return full

    def load_state_dict(self, state_dict) -> None:
        """Load a state dict in the plain Adam format, saved at any world size: each rank
        keeps the slices of its own shard. Hyperparameters come from the saved groups, as
        with ``torch.optim``; the caller's dict is not modified.

        Raises:
            ValueError: if the groups, parameter counts or state shapes do not match this
                optimizer's parameters; the message names the first mismatch.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state has {len(saved_groups)} param groups, this optimizer has "
                f"{len(self.param_groups)}"
            )
        saved_ids = []
        for gi, (sg, g) in enumerate(zip(saved_groups, self.param_groups)):
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(
                    f"param group {gi}: loaded state has {len(sg['params'])} parameters, "
                    f"this optimizer has {len(g['params'])}"
                )
            saved_ids.extend(sg["params"])
        saved_state = state_dict["state"]
        steps = [0] * len(self._params)
        entries = []
        for i, (sid, p) in enumerate(zip(saved_ids, self._params)):
            entry = saved_state.get(sid)
            if entry is not None:
                for key in ("exp_avg", "exp_avg_sq"):
                    if key not in entry:
                        raise ValueError(f"parameter {i}: loaded state has no '{key}'")
                    if tuple(entry[key].shape) != tuple(p.shape):
                        raise ValueError(
                            f"parameter {i}: loaded {key} has shape {tuple(entry[key].shape)}, "
                            f"the parameter has shape {tuple(p.shape)}"
                        )
                steps[i] = int(entry["step"])
            entries.append(entry)

        for i, entry in enumerate(entries):
            for bi, pc in self._param_shards.get(i, []):
                for key, local in (("exp_avg", self._exp_avg), ("exp_avg_sq", self._exp_avg_sq)):
                    dst = local[bi][pc.offset : pc.offset + pc.numel]
                    if entry is None:
                        dst.zero_()
                    else:
                        src = entry[key].reshape(-1)[pc.param_offset : pc.param_offset + pc.numel]
                        dst.copy_(src)
        self._steps = steps
        for sg, g in zip(saved_groups, self.param_groups):
            for k, v in sg.items():
                if k != "params":
                    g[k] = v


def _adam_update(p, grad, exp_avg, exp_avg_sq, step: int, group) -> None:
    """One Adam update, written as ``fairseq.optim.adam.Adam.step`` writes it (same ops,
    same order, same Python-float scalars), so the results are bitwise equal."""
    beta1, beta2 = group["betas"]
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = exp_avg_sq.sqrt().add_(group["eps"])
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = group["lr"] * math.sqrt(bias_correction2) / bias_correction1
    if group["weight_decay"] != 0:
        p.add_(p, alpha=-group["weight_decay"] * group["lr"])
    p.addcdiv_(exp_avg, denom, value=-step_size)

"""``ShardedAdam``: fairseq's Adam with its state sharded across data-parallel ranks.

Owns the optimizer step and the mapping between the sharded state and the plain
``torch.optim`` state-dict format. The layout comes from :mod:`fairseq_oss.optim.partition`;
the collectives live in :mod:`fairseq_oss.optim.collectives`, the step's hand-over of
the updated shards in :mod:`fairseq_oss.optim.param_exchange`; moving the state into a
checkpoint and back is :mod:`fairseq_oss.checkpoint`'s job, through this class's public
accessors (:meth:`ShardedAdam.state_shards`, :meth:`ShardedAdam.fill_shards`, ...). It does
no file I/O and does not touch fairseq.

Numerics: each rank applies exactly the arithmetic of ``fairseq.optim.adam.Adam`` (the
optimizer ``--optimizer adam`` uses on CPU) to its shard, element by element, in the same
order; element-wise kernels give the same bits on a slice as on the whole tensor, so the
parameters equal plain Adam's bit for bit at any world size (``tests/test_sharded_adam.py``).

Every rank holds, besides the parameters, only:

* ``exp_avg`` and ``exp_avg_sq`` for its shard of each bucket (about 1/N of Adam's state);
* the step count of every parameter (one int each: parameters are stepped on every rank
  alike, since data parallelism gives all ranks the same set of gradients);
* with ``exchange="all_gather"`` only, two gather buffers of one bucket each, per dtype.

The step updates each rank's shard in place, in the parameters' own memory, and hands it
to the other ranks straight from there (point to point on gloo) or through one gather
buffer per bucket (NCCL's all-gather): on gloo, no copy of a parameter or gradient at all.
"""
import math
from typing import Dict, List, Optional, Tuple

import torch

from fairseq_oss.optim import collectives, gather, param_reads
from fairseq_oss.optim.param_exchange import ParamExchange
from fairseq_oss.optim.partition import (
    Bucket, ParamSpec, Partition, Piece, bucket_count, bucket_onto, onto, partition,
)

_LOW_PRECISION = (torch.float16, torch.bfloat16)
DEFAULT_BUCKET_BYTES = 32 * 2**20


class TooManyBuckets(ValueError):
    """The bucket size cuts the parameters into more buckets than allowed."""

    def __init__(self, count: int, total_bytes: int):
        super().__init__(f"the bucket size cuts {total_bytes} bytes of parameters into {count} buckets")
        self.count, self.total_bytes = count, total_bytes


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
        bucket_bytes: size of one bucket. Collectives move one bucket at a time, so this
            bounds the extra memory of a step and of a consolidation.
        exchange: how the step hands each rank's updated shard to the others: ``"p2p"``
            (point to point, straight from and into the parameters: no copies, no
            buffers) or ``"all_gather"`` (one ``all_gather_into_tensor`` per bucket
            through two gather buffers). ``None``: ``"p2p"`` on gloo, whose all-gather
            stages through temporary buffers of its own, else ``"all_gather"`` (NCCL).
        max_buckets: refuse a bucket size that makes more buckets than this
            (:class:`TooManyBuckets`), before anything is allocated; ``None``: no limit.
        defer_exchange: :meth:`step` returns with the exchange in flight; on the thread
            that stepped, a torch function given a parameter waits for that parameter's
            pieces first, until all have arrived (:func:`~fairseq_oss.optim.param_reads.watch`);
            another thread waits on :attr:`param_exchange` first. Also settable as an attribute.

    Raises:
        ValueError: for ``amsgrad=True`` (fairseq never enables it), a sparse or
            non-contiguous parameter, a non-positive bucket size or an unknown exchange;
            :class:`TooManyBuckets` (a ValueError) past ``max_buckets``.

    .. warning:: The constructor, :meth:`step` and :meth:`consolidate_state_dict` are
        collective: call them on all ranks of ``process_group``, in the same order.
    """

    # What fairseq's mixed-precision wrappers ask of an optimizer (fairseq's own Adam
    # answers the same). --fp16 hands over one flat fp32 master tensor: the partition is
    # element-granular, so it shards like any other parameter. --memory-efficient-fp16
    # hands over the fp16/bf16 parameters themselves: the state is fp32 (_state_dtype)
    # and each piece is updated in fp32, as fairseq's Adam does.
    supports_flat_params = True
    supports_memory_efficient_fp16 = True
    # MemoryEfficientFP16Optimizer.load_state_dict would otherwise copy the whole loaded
    # state into ``self.state`` (its workaround for torch casting fp32 state to fp16):
    # this optimizer keeps its own fp32 shards and loads only them.
    disable_mem_eff_fp16_loading_hack = True

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
        exchange: Optional[str] = None,
        max_buckets: Optional[int] = None,
        defer_exchange: bool = False,
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
        if exchange is None:
            exchange = "p2p" if collectives.backend(process_group) == "gloo" else "all_gather"
        if exchange not in ("p2p", "all_gather"):
            raise ValueError(f"exchange must be 'p2p' or 'all_gather', got {exchange!r}")
        self.exchange = exchange
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
        bucket_numel = max(1, bucket_bytes // itemsize)
        count = bucket_count(specs, self.world_size, bucket_numel)
        if max_buckets is not None and count > max_buckets:
            raise TooManyBuckets(count, sum(p.numel() * p.element_size() for p in self._params))
        self.partition: Partition = partition(specs, self.world_size, bucket_numel)
        # Each bucket's pieces as rank r's shard holds them (offsets within the shard): every
        # step walks them, for its own rank's update and for every rank's exchange.
        self._shards: List[List[Tuple[Piece, ...]]] = [
            [b.shard_pieces(r) for r in range(self.world_size)] for b in self.partition.buckets
        ]
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
        self.param_exchange = ParamExchange(self._params, self.partition.buckets, self._shards, exchange, process_group)
        self.defer_exchange = defer_exchange
        # With exchange_into: per bucket, (parameter, offset, target, offset, numel) of
        # this rank's shard, copied from the parameters into the targets after its update.
        self._copies: Optional[List[List[Tuple[int, int, int, int, int]]]] = None
        self._targets: List[torch.Tensor] = []
        # (shards, used) of a reduce-scatter, for the next step; None: use ``.grad``.
        self._reduced: Optional[Tuple[List[torch.Tensor], List[bool]]] = None
        self._consolidated: Optional[Dict[int, Dict[str, torch.Tensor]]] = None

    # ------------------------------------------------------------------ layout helpers

    def add_param_group(self, param_group):
        if self._frozen_groups:
            raise NotImplementedError("ShardedAdam cannot add param groups after construction")
        super().add_param_group(param_group)

    def _flat(self, index: int) -> torch.Tensor:
        return self._params[index].data.view(-1)

    @property
    def params(self) -> List[torch.Tensor]:
        """The parameters, in optimizer order (the order of the state dict's indices)."""
        return self._params

    @property
    def steps(self) -> List[int]:
        """Each parameter's step count (0: no state yet)."""
        return self._steps

    def set_steps(self, steps: List[int]) -> None:
        self._steps = list(steps)

    state_dtype = staticmethod(_state_dtype)

    def state_bytes(self) -> int:
        """Bytes of Adam state (exp_avg and exp_avg_sq) held by this rank."""
        return sum(t.numel() * t.element_size() for t in self._exp_avg + self._exp_avg_sq)

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure=None):
        """Update this rank's shard of every parameter, in place, then exchange the
        buckets' shards so that every rank holds the full updated parameters (or, with
        ``defer_exchange``, will hold them once :attr:`param_exchange` is waited for).

        .. warning:: Collective: call on all ranks.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._reduced is not None:
            for i, used in enumerate(self._reduced[1]):
                self._steps[i] += used
        else:
            for i, p in enumerate(self._params):
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise RuntimeError(
                            "Adam does not support sparse gradients, please consider SparseAdam instead"
                        )
                    self._steps[i] += 1

        # What the previous step left in flight: the updates below write into the memory
        # its sends read from.
        self.param_exchange.wait_all()
        param_reads.settle()
        for b in self.partition.buckets:
            self._update_shard(b)
            if self._copies is not None:
                self._copy_into_targets(b)
            self.param_exchange.start(b)  # in flight while the next bucket is updated
        if self.defer_exchange:
            param_reads.watch(self.param_exchange)  # a read on this thread waits for what it reads
        else:
            self.param_exchange.wait_all()
        self._reduced = None
        return loss

    def exchange_into(self, targets: List[torch.Tensor], layout: List[List[Tuple[int, int]]]) -> None:
        """Let the model read low-precision copies of the parameters: fairseq's ``--fp16``
        steps a flat fp32 master copy (the parameters here) of the model's fp16 parameters
        (``targets``; ``layout[i]``: the ``(target index, numel)`` laid end to end in
        parameter ``i``). From now on each step writes this rank's updated shard into the
        targets, converted to their dtype (fairseq's ``_sync_fp32_params_to_fp16`` of that
        shard), and exchanges the targets, in their dtype, instead of the parameters.

        The parameters are then up to date on each rank in its own shards only: nothing
        but this optimizer's step may read them (fairseq never does: it saves and
        evaluates the model, and rebuilds its master copy from the model when it loads).
        Not collective; every rank calls it alike, between steps.
        """
        self.param_exchange.wait_all()
        param_reads.settle()
        buckets = [bucket_onto(b, layout) for b in self.partition.buckets]
        shards = [[b.shard_pieces(r) for r in range(self.world_size)] for b in buckets]
        self._copies = [
            [
                (pm.param, pm.param_offset + pt.offset - pm.offset, pt.param, pt.param_offset, pt.numel)
                for pm in self._shards[b.index][self.rank]
                for pt in onto([pm], layout)
            ]
            for b in self.partition.buckets
        ]
        self._targets = list(targets)
        self.param_exchange = ParamExchange(self._targets, buckets, shards, self.exchange, self.process_group)

    def _copy_into_targets(self, bucket: Bucket) -> None:
        for param, offset, target, target_offset, numel in self._copies[bucket.index]:
            dst = self._targets[target].data.view(-1)[target_offset : target_offset + numel]
            dst.copy_(self._flat(param)[offset : offset + numel])

    # ------------------------------------------------------------------ reduced gradients

    def set_reduced_grads(self, shards: List[torch.Tensor], used: List[bool]) -> None:
        """Take the next step from ``shards`` (this rank's shard of each bucket's summed
        gradient, as :class:`~fairseq_oss.optim.grad_reduction.GradReducer` leaves it)
        instead of the parameters' ``.grad``; ``used[i]``: parameter ``i`` has a gradient
        (is stepped) at all. Until the step or :meth:`zero_grad`."""
        self._reduced = (shards, list(used))

    def reduced_grads(self) -> Optional[List[torch.Tensor]]:
        """This rank's shards of the reduced gradients, or None (they are in ``.grad``)."""
        return None if self._reduced is None else self._reduced[0]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._reduced = None

    def _piece_view(self, pc: Piece) -> torch.Tensor:
        """The parameter's own elements that ``pc`` covers (a view: writes land in it)."""
        return self._flat(pc.param)[pc.param_offset : pc.param_offset + pc.numel]

    def _update_shard(self, bucket: Bucket) -> None:
        """Apply Adam, in place, to this rank's part of the bucket's parameters, piece by
        piece (a piece is one parameter's run of elements), as fairseq's Adam applies it
        to each whole parameter; pieces without a gradient are left as they are. Pieces
        held in fp32 are updated together: from a reduced shard (one flat gradient, like
        the state) by :func:`_adam_update_shard`, in cache-sized runs; from ``.grad`` one
        multi-tensor op per line of Adam (:func:`_adam_update_pieces`). fp16/bf16 ones one
        by one, through fp32 copies."""
        group = self.param_groups[bucket.group]
        exp_avg, exp_avg_sq = self._exp_avg[bucket.index], self._exp_avg_sq[bucket.index]
        flat_grad = None if self._reduced is None else self._reduced[0][bucket.index]
        together = ([], [], [], [], [])  # parameters, gradients, exp_avg, exp_avg_sq, steps
        in_flat = []  # (piece, parameter view): fp32 pieces stepped from flat_grad
        for pc in self._shards[bucket.index][self.rank]:
            if flat_grad is not None:
                if not self._reduced[1][pc.param]:
                    continue
                grad = flat_grad[pc.offset : pc.offset + pc.numel]
            else:
                g = self._params[pc.param].grad
                if g is None:
                    continue
                grad = g.reshape(-1)[pc.param_offset : pc.param_offset + pc.numel]
            p = self._piece_view(pc)
            lo, hi = pc.offset, pc.offset + pc.numel
            if p.dtype not in _LOW_PRECISION and grad.dtype not in _LOW_PRECISION:
                if flat_grad is not None:
                    in_flat.append((pc, p))
                    continue
                for lst, t in zip(together, (p, grad, exp_avg[lo:hi], exp_avg_sq[lo:hi], self._steps[pc.param])):
                    lst.append(t)
                continue
            p_fp32 = p.float() if p.dtype in _LOW_PRECISION else p
            _adam_update(p_fp32, grad.float(), exp_avg[lo:hi], exp_avg_sq[lo:hi], self._steps[pc.param], group)
            if p_fp32 is not p:
                p.copy_(p_fp32)
        if together[0]:
            _adam_update_pieces(*together, group)
        if in_flat:
            steps = [self._steps[pc.param] for pc, _ in in_flat]
            _adam_update_shard(in_flat, steps, flat_grad, exp_avg, exp_avg_sq, group)

    # ------------------------------------------------------------------ state dict

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Gather the full Adam state on ``recipient_rank`` (a rank of ``process_group``),
        one bucket at a time, as tensors (never pickles), for :meth:`state_dict` there;
        other ranks only send. The recipient holds the whole state in memory: for a
        checkpoint, :func:`fairseq_oss.checkpoint.save_optimizer_state` streams it into
        the file instead.

        .. warning:: Collective: call on all ranks, before :meth:`state_dict` on the recipient.
        """
        self._consolidated = gather.gather_in_memory(self, recipient_rank) if self.world_size > 1 else None

    def state_shards(self):
        return (("exp_avg", self._exp_avg), ("exp_avg_sq", self._exp_avg_sq))

    def shard_ranges(self, bucket: Bucket):
        return [bucket.shard_range(r) for r in range(self.world_size)]

    def state_bucket_buffers(self) -> Dict[str, torch.Tensor]:
        """One bucket of state per kind, reused by every gather or scatter of a pass."""
        return gather.bucket_buffers(self)

    def state_dict(self):
        """The state in the format of ``fairseq.optim.adam.Adam.state_dict()``: one entry
        per stepped parameter with ``step`` (int), ``exp_avg`` and ``exp_avg_sq`` shaped
        like the parameter, and one ``param_groups`` list.

        With several ranks, only the recipient of :meth:`consolidate_state_dict` can call
        this, once per consolidation (the gathered copy is handed over, not kept).

        Raises:
            RuntimeError: if the state was not consolidated on this rank.
        """
        consolidated, self._consolidated = self._consolidated, None
        if consolidated is None and self.world_size == 1:
            consolidated = self._local_full_state()
        if consolidated is None:
            raise RuntimeError(
                "ShardedAdam.state_dict() on a sharded optimizer needs "
                "consolidate_state_dict() to be called on all ranks first, and is only "
                f"available on the recipient rank (this is rank {self.rank})"
            )
        return self.state_dict_of(consolidated)

    def state_dict_of(self, tensors: Dict[int, Dict[str, torch.Tensor]], steps: Optional[List[int]] = None):
        """The plain Adam state dict whose stepped parameters' ``exp_avg`` and
        ``exp_avg_sq`` are ``tensors`` (by parameter index: gathered tensors, or the
        placeholders of tensors written into a checkpoint), with ``steps`` (default: the
        current ones) and this optimizer's param groups."""
        steps = self._steps if steps is None else steps
        state = {
            i: {"step": steps[i], "exp_avg": t["exp_avg"], "exp_avg_sq": t["exp_avg_sq"]}
            for i, t in sorted(tensors.items())
        }
        return {"state": state, "param_groups": self.saved_param_groups()}

    def saved_param_groups(self):
        """The param groups as a state dict holds them (parameters as global indices)."""
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
            for key, local in self.state_shards():
                parts = [
                    local[bi][pc.offset : pc.offset + pc.numel]
                    for bi, pc in self._param_shards.get(i, [])
                ]
                flat = parts[0] if len(parts) == 1 else torch.cat(parts)
                entry[key] = flat.clone().view(p.shape)
            full[i] = entry
        return full

    def validate_state(self, state_dict, source: str = "loaded state") -> Tuple[List[int], List]:
        """Check ``state_dict`` against this optimizer's parameters; return the step of
        each parameter (0 where it has no state) and each parameter's key in the state.

        Raises:
            ValueError: naming the first mismatch.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"{source} has {len(saved_groups)} param groups, this optimizer has "
                f"{len(self.param_groups)}"
            )
        saved_ids = []
        for gi, (sg, g) in enumerate(zip(saved_groups, self.param_groups)):
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(
                    f"param group {gi}: {source} has {len(sg['params'])} parameters, "
                    f"this optimizer has {len(g['params'])}"
                )
            saved_ids.extend(sg["params"])
        saved_state = state_dict["state"]
        steps = [0] * len(self._params)
        for i, (sid, p) in enumerate(zip(saved_ids, self._params)):
            entry = saved_state.get(sid)
            if entry is None:
                continue
            for key in ("step", "exp_avg", "exp_avg_sq"):
                if key not in entry:
                    raise ValueError(f"parameter {i}: {source} has no '{key}'")
            for key in ("exp_avg", "exp_avg_sq"):
                t = entry[key]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(
                        f"parameter {i}: {source} {key} has shape {tuple(t.shape)}, "
                        f"the parameter has shape {tuple(p.shape)}"
                    )
                if t.dtype != _state_dtype(p.dtype):
                    raise ValueError(
                        f"parameter {i}: {source} {key} has dtype {t.dtype}, this optimizer keeps "
                        f"{_state_dtype(p.dtype)} for a {p.dtype} parameter"
                    )
            steps[i] = int(entry["step"])
        return steps, saved_ids

    def load_state_dict(self, state_dict) -> None:
        """Load a state dict in the plain Adam format, saved at any world size: each rank
        keeps the slices of its own shard. Hyperparameters come from the saved groups, as
        with ``torch.optim``; the caller's dict is not modified.

        To load from a checkpoint file, each rank reading only its own slices, see
        :func:`fairseq_oss.checkpoint.load_optimizer_state`.

        Raises:
            ValueError: if the groups, parameter counts or state shapes do not match this
                optimizer's parameters; the message names the first mismatch. Nothing is
                changed then.
        """
        steps, saved_ids = self.validate_state(state_dict)
        entries = [state_dict["state"].get(sid) for sid in saved_ids]
        self.fill_shards(lambda i, k, start, end, dst: dst.copy_(entries[i][k].reshape(-1)[start:end]), steps)
        self.apply_groups(state_dict["param_groups"])

    def fill_shards(self, fill, steps: List[int]) -> None:
        """Fill this rank's shards: ``fill(param, key, start, end, dst)`` writes elements
        ``[start, end)`` of the parameter's flattened state into ``dst``; zeros where it
        has no state."""
        for i in range(len(self._params)):
            for bi, pc in self._param_shards.get(i, []):
                for key, local in self.state_shards():
                    dst = local[bi][pc.offset : pc.offset + pc.numel]
                    if steps[i] == 0:
                        dst.zero_()
                    else:
                        fill(i, key, pc.param_offset, pc.param_offset + pc.numel, dst)
        self._steps = steps

    def apply_groups(self, saved_groups) -> None:
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


def _adam_update_pieces(params, grads, exp_avgs, exp_avg_sqs, steps: List[int], group) -> None:
    """:func:`_adam_update` on many tensors at once (torch's ``_foreach`` ops: a few kernel
    launches per bucket instead of a few per parameter, which is what a step of many small
    parameters costs on a GPU). The same element-wise arithmetic in the same order, with
    each tensor's own step size; on CPU torch runs these ops tensor by tensor."""
    beta1, beta2 = group["betas"]
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denoms, group["eps"])
    step_sizes = _step_sizes(steps, group)
    if group["weight_decay"] != 0:
        torch._foreach_add_(params, params, alpha=-group["weight_decay"] * group["lr"])
    torch._foreach_addcdiv_(params, exp_avgs, denoms, step_sizes)


def _step_sizes(steps: List[int], group) -> List[float]:
    """Minus :func:`_adam_update`'s ``step_size`` for each step count, as a Python float
    computed in the same order (so the same bits)."""
    beta1, beta2 = group["betas"]
    return [-(group["lr"] * math.sqrt(1 - beta2**s) / (1 - beta1**s)) for s in steps]


# Elements of a shard that _adam_update_shard takes through all of Adam's lines before the
# next ones, on CPU: 1 MiB per fp32 tensor, so that what one line writes is still in the
# cache when the next line reads it (a shard of 2.7M elements read afresh from memory by
# each of Adam's eight passes took 1.15x to 1.35x as long, in training at 2 ranks on this
# project's 2-core machine). Elsewhere a run is taken whole, in one kernel launch per line.
CPU_RUN = 1 << 18


def _adam_update_shard(pieces, steps: List[int], grad, exp_avg, exp_avg_sq, group) -> None:
    """:func:`_adam_update` on a shard's fp32 pieces, from its flat gradient: the lines of
    Adam that touch the state only (``exp_avg``, ``exp_avg_sq`` and the denominator) run
    on the shard's elements as they lie, one op over many pieces, and those that touch the
    parameters on each piece's view (``pieces``: ``(Piece, parameter view)`` in the shard's
    order, ``steps`` their step counts). The same element-wise arithmetic in the same order as
    :func:`_adam_update`, so the same bits; elements of no piece (a parameter without a
    gradient, the padding) are not touched."""
    beta1, beta2 = group["betas"]
    decay = -group["weight_decay"] * group["lr"]
    sizes = _step_sizes(steps, group)
    runs = []  # [lo, hi, [piece indices]]: pieces that lie end to end in the shard, in offset order
    for k, (pc, _) in enumerate(pieces):
        if runs and runs[-1][1] == pc.offset:
            runs[-1][1] += pc.numel
            runs[-1][2].append(k)
        else:
            runs.append([pc.offset, pc.offset + pc.numel, [k]])
    longest = max((hi - lo for lo, hi, _ in runs), default=0)
    if longest == 0:
        return
    stretch = min(CPU_RUN, longest) if grad.device.type == "cpu" else longest
    denom = torch.empty(stretch, dtype=exp_avg.dtype, device=exp_avg.device)
    for lo, hi, members in runs:
        first = 0  # the first of the run's pieces that the next stretch reaches
        for a in range(lo, hi, stretch):
            z = min(hi, a + stretch)
            g, m, v = grad[a:z], exp_avg[a:z], exp_avg_sq[a:z]
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            d = torch.sqrt(v, out=denom[: z - a]).add_(group["eps"])
            params, avgs, denoms, step_sizes = [], [], [], []
            for k in members[first:]:  # in offset order, end to end
                pc, view = pieces[k]
                if pc.offset >= z:  # past this stretch
                    break
                s, e = max(a, pc.offset), min(z, pc.offset + pc.numel)
                if e == pc.offset + pc.numel:
                    first += 1  # done with it
                params.append(view[s - pc.offset : e - pc.offset])
                avgs.append(exp_avg[s:e])
                denoms.append(d[s - a : e - a])
                step_sizes.append(sizes[k])
            if group["weight_decay"] != 0:
                torch._foreach_add_(params, params, alpha=decay)
            torch._foreach_addcdiv_(params, avgs, denoms, step_sizes)

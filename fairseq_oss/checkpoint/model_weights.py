"""The model's weights in a checkpoint, written by every rank: 1/N each.

Every data-parallel rank holds the same weights, so the ranks can share the writing of
them as they share the Adam state's. :class:`ModelWeights` describes, the same on every
rank, the records that the model's ``state_dict()`` becomes in the checkpoint, and those of
the other state dicts of weights that the checkpoint holds (a criterion's, fairseq's EMA
model's), each at its path in the checkpoint (:meth:`ModelWeights.of_parts`):

* one record per storage, as ``torch.save`` writes them (tensors that share a storage,
  such as tied embeddings, share one record), float16 and bfloat16 ones as float32, as
  fairseq's ``utils.move_to_cpu`` saves them;
* which elements of them rank r of N writes (:meth:`ModelWeights.share`: the bytes of
  the records that every rank holds alike, the parameters', cut into N runs of about equal
  length, at element bounds; a record that may differ between ranks, a buffer such as
  BatchNorm's running statistics, which each rank updates from its own batches, written
  whole by rank 0, whose values fairseq saves);
* on rank 0, once the records are written, the state dict that stands in for the
  model's in the pickled checkpoint: :class:`~fairseq_oss.checkpoint.format.StreamedTensor`
  placeholders that load as the model's tensors (:meth:`ModelWeights.state_dict`), one
  such state dict per part.

Owns that layout, the bytes it reads from the model's tensors (copied to the CPU and cast
a block at a time) and their snapshot for a background save. No collectives, no files.
"""
import collections
import copy
import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from fairseq_oss.checkpoint.format import RecordPlan, StorageRef, StreamedTensor

logger = logging.getLogger(__name__)

Path = Tuple[str, ...]  # where a state dict of weights lies in the checkpoint: ("extra_state", "ema")
Alike = Callable[[Path, str, torch.Tensor], bool]  # whether every rank holds that entry's values alike

# fairseq.utils.move_to_cpu saves half-precision tensors as float32
_SAVED_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
_BLOCK_BYTES = 64 << 20  # the most converted or copied to the CPU at once, per part
_ALIGN = 4096  # runs start at multiples of this many bytes of the records' concatenation


@dataclass(frozen=True)
class _Record:
    source: torch.Tensor  # 1-D: the whole storage, in its tensors' dtype (on their device)
    dtype: torch.dtype  # in the file
    alike: bool = True  # every rank holds the same values (else rank 0 writes it whole)

    @property
    def numel(self) -> int:
        return self.source.numel()

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


MODEL = ("model",)  # the model's path in a fairseq checkpoint


@dataclass(frozen=True)
class _Entry:
    part: int  # index into ModelWeights.paths
    name: str
    record: int
    storage_offset: int
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]


@dataclass
class WeightsShell:
    """A model state dict without its tensors: its keys in order, its other values and
    its ``_metadata``. Stands in for the model in the checkpoint handed to a background
    save until its records are written."""

    keys: List[str]
    others: dict
    metadata: Optional[dict]
    part: int = 0  # index into ModelWeights.paths


class ModelWeights:
    """The checkpoint records of a model's state dict and of any other part of the weights
    (see the module docstring). Build it with :meth:`of` or :meth:`of_parts` on every rank,
    from the state dicts the trainer saves."""

    def __init__(self, records: List[_Record], entries: List[_Entry], paths: Sequence[Path] = (MODEL,)):
        self.records, self.entries, self.paths = records, entries, list(paths)
        self.names: Optional[List[str]] = None  # "data/KEY" per record, on rank 0 once written
        self._frozen = None  # (rank, world_size, parts per record) of a snapshot

    @classmethod
    def of(cls, state_dict) -> Optional["ModelWeights"]:
        """The layout of ``state_dict``'s tensors (the checkpoint's model), or None where a
        tensor is not a plain strided CPU or CUDA tensor (DTensor, quantized, sparse, ...):
        rank 0 then pickles the model whole, as before."""
        return cls.of_parts({MODEL: state_dict})

    @classmethod
    def of_parts(cls, parts: Dict[Path, dict], alike: Optional[Alike] = None) -> Optional["ModelWeights"]:
        """The layout of several state dicts' tensors, each at its path in the checkpoint
        (``("model",)``, ``("extra_state", "ema")``, ...), their records in that order; a
        storage shared across them is one record, as ``torch.save`` writes it. None where
        any tensor of any of them is not one it can describe: rank 0 then pickles them all.
        ``alike(path, name, tensor)``: whether every rank holds that tensor's values alike
        (default: every tensor); a record with any tensor that is not is rank 0's to write."""
        sources: List[Tuple[torch.Tensor, torch.dtype]] = []
        same: List[bool] = []
        entries: List[_Entry] = []
        index = {}
        for part, (path, state_dict) in enumerate(parts.items()):
            if not isinstance(state_dict, dict):
                return None
            for name, t in state_dict.items():
                if not torch.is_tensor(t):
                    continue
                if (type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided or t.is_quantized
                        or t.requires_grad or t.is_conj() or t.is_neg() or t.device.type not in ("cpu", "cuda")):
                    return None
                storage = t.untyped_storage()
                key = (storage.data_ptr(), storage.nbytes(), str(t.device), t.dtype)
                i = index.get(key)
                if i is None:
                    if storage.nbytes() % t.element_size():
                        return None
                    source = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                        storage, 0, (storage.nbytes() // t.element_size(),), (1,))
                    i = index[key] = len(sources)
                    sources.append((source, _SAVED_DTYPE.get(t.dtype, t.dtype)))
                    same.append(True)
                same[i] = same[i] and (alike is None or bool(alike(path, name, t)))
                entries.append(_Entry(part, name, i, t.storage_offset(), tuple(t.shape), tuple(t.stride())))
        records = [_Record(source, dtype, a) for (source, dtype), a in zip(sources, same)]
        return cls(records, entries, parts.keys())

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.records)

    def share(self, rank: int, world_size: int) -> List[List[Tuple[int, int]]]:
        """Per record, the element ranges ``[start, end)`` that ``rank`` of ``world_size``
        writes: of the records that every rank holds alike, about 1/N of their bytes; the
        others, whole, on rank 0. The ranks' shares tile every record exactly."""
        total = sum(r.nbytes for r in self.records if r.alike)
        lo = _cut(total, rank, world_size)
        hi = _cut(total, rank + 1, world_size)
        out, at = [], 0
        for r in self.records:
            if not r.alike:
                out.append([(0, r.numel)] if rank == 0 and r.numel else [])
                continue
            size = r.itemsize
            start = min(max(lo - at, 0) // size, r.numel)
            end = min(max(hi - at, 0) // size, r.numel)
            out.append([(start, end)] if end > start else [])
            at += r.nbytes
        return out

    def plans(self, rank: int, world_size: int) -> List[RecordPlan]:
        """One :class:`RecordPlan` per record, with the parts that ``rank`` writes (read
        from the tensors as they are now, or from the snapshot, if this is one)."""
        if self._frozen is not None:
            frozen_rank, frozen_size, parts = self._frozen
            if (frozen_rank, frozen_size) != (rank, world_size):
                raise ValueError(f"a snapshot of rank {frozen_rank} of {frozen_size}'s share, not {rank} of {world_size}")
            return [RecordPlan(r.nbytes, p) for r, p in zip(self.records, parts)]
        return [
            RecordPlan(r.nbytes, [(a * r.itemsize, _reader(r, a, b)) for a, b in _blocks(r, ranges)])
            for r, ranges in zip(self.records, self.share(rank, world_size))
        ]

    def snapshot(self, rank: int, world_size: int, copy_to: Callable) -> "ModelWeights":
        """A copy of ``rank``'s share on the CPU, in the file's dtypes: ``copy_to(key,
        tensor, dtype)`` returns a CPU copy of ``tensor`` (in a buffer it may reuse).
        Only that rank's :meth:`plans` can be asked of it."""
        parts = [
            [(a * r.itemsize, copy_to(("weights", i, a), r.source[a:b], r.dtype)) for a, b in _blocks(r, ranges)]
            for i, (r, ranges) in enumerate(zip(self.records, self.share(rank, world_size)))
        ]
        # the frozen copy keeps the layout, not the model's tensors
        frozen = ModelWeights([_Record(torch.empty(r.numel, dtype=r.dtype, device="meta"), r.dtype, r.alike)
                               for r in self.records], self.entries, self.paths)
        frozen._frozen = (rank, world_size, parts)
        return frozen

    def shell(self, state_dict, copy_others=lambda x: x, part: int = 0) -> Optional[WeightsShell]:
        """``state_dict`` (part ``part`` of the checkpoint about to be pickled: the model's
        entry by default) without its tensors, if its tensors are the ones this layout
        describes (same names in the same order, shapes and saved dtypes); else None,
        logged: rank 0 then pickles them itself (the records written stay in the file, unused)."""
        reason = self._mismatch(state_dict, part)
        if reason is not None:
            logger.warning("oss_adam: the checkpoint's %s is written again by rank 0 (%s)",
                           ".".join(self.paths[part]), reason)
            return None
        others = collections.OrderedDict((k, v) for k, v in state_dict.items() if not torch.is_tensor(v))
        metadata = getattr(state_dict, "_metadata", None)
        return WeightsShell(list(state_dict.keys()), copy_others(others), copy.deepcopy(metadata), part)

    def _mismatch(self, state_dict, part: int) -> Optional[str]:
        where = ".".join(self.paths[part])
        if not isinstance(state_dict, dict):
            return f"the checkpoint's {where} is a {type(state_dict).__name__}"
        tensors = [(k, v) for k, v in state_dict.items() if torch.is_tensor(v)]
        mine = [e for e in self.entries if e.part == part]
        if [k for k, _ in tensors] != [e.name for e in mine]:
            return f"the checkpoint's {where} has other entries than the state dict described"
        for (k, t), e in zip(tensors, mine):
            want = self.records[e.record].dtype
            if tuple(t.shape) != e.shape or t.dtype != want:
                return f"{k} is {t.dtype} {tuple(t.shape)} in the checkpoint, {want} {e.shape} in the records"
        return None

    def state_dict(self, shell: WeightsShell) -> "collections.OrderedDict":
        """The state dict of ``shell``'s part for the pickle: each tensor a placeholder that
        views its written record (rank 0, after the records were written)."""
        if self.names is None:
            raise RuntimeError("the model's records were not written")
        refs = [StorageRef(name.split("/", 1)[1], r.dtype, r.numel) for name, r in zip(self.names, self.records)]
        by_name = {e.name: e for e in self.entries if e.part == shell.part}
        out = collections.OrderedDict()
        for k in shell.keys:
            e = by_name.get(k)
            out[k] = shell.others[k] if e is None else StreamedTensor(refs[e.record], e.storage_offset, e.shape,
                                                                      e.stride)
        if shell.metadata is not None:
            out._metadata = shell.metadata
        return out


def with_shell(obj, weights: Optional[ModelWeights], copy_others=lambda x: x):
    """``obj`` (the checkpoint about to be pickled, on rank 0) with each part of the written
    weights (its model, its EMA, ...) replaced by its :class:`WeightsShell`, where the part
    holds the tensors described (else left, logged by :meth:`ModelWeights.shell`)."""
    if weights is None or not isinstance(obj, dict):
        return obj
    for part, path in enumerate(weights.paths):
        state_dict = _get(obj, path)
        if state_dict is not _ABSENT:
            shell = weights.shell(state_dict, copy_others, part)
            if shell is not None:
                obj = _replaced(obj, path, shell)
    return obj


def with_placeholders(obj, weights: Optional[ModelWeights]):
    """``obj`` (a checkpoint) with each :class:`WeightsShell` that stands in for a part of
    its weights replaced by the written records' placeholders (rank 0, once they are written)."""
    if weights is None or not isinstance(obj, dict):
        return obj
    for path in weights.paths:
        shell = _get(obj, path)
        if isinstance(shell, WeightsShell):
            obj = _replaced(obj, path, weights.state_dict(shell))
    return obj


_ABSENT = object()


def _get(obj, path: Path):
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return _ABSENT
        obj = obj[key]
    return obj


def _replaced(obj: dict, path: Path, value) -> dict:
    """A shallow copy of ``obj`` with ``value`` at ``path`` (the dicts along it copied too)."""
    out = copy.copy(obj)
    out[path[0]] = value if len(path) == 1 else _replaced(obj[path[0]], path[1:], value)
    return out


def _cut(total: int, k: int, n: int) -> int:
    """Where run ``k`` of ``n`` starts in ``total`` bytes: aligned, the last one at the end."""
    return total if k >= n else total * k // n // _ALIGN * _ALIGN


def _blocks(record: _Record, ranges):
    """``ranges`` cut into blocks of at most _BLOCK_BYTES in the file's dtype."""
    step = max(1, _BLOCK_BYTES // record.itemsize)
    for a, b in ranges:
        for s in range(a, b, step):
            yield s, min(b, s + step)


def _reader(record: _Record, a: int, b: int):
    """Elements ``[a, b)`` of ``record`` as the file holds them: a view where the tensor
    is on the CPU in that dtype, else a converted copy made when asked."""
    return lambda: record.source[a:b].to(device="cpu", dtype=record.dtype)

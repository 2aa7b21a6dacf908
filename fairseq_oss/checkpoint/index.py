"""What a checkpoint holds and where, without reading its tensors.

Owns the *index* of a zip checkpoint (``torch.save``'s, stock fairseq's or this
package's): its object tree with every tensor replaced by a ``meta`` tensor of the same
shape, dtype, storage offset and strides, and for each tensor the record (``data/KEY``)
and byte range of the file that hold its values. Building it reads the pickle and the
zip's directory (and the manifest, if any): memory and time do not grow with the
tensors' size. The pickle is read by torch's ``weights_only`` unpickler, with the types
of :mod:`fairseq_oss.checkpoint.safe_load`: nothing from the file runs.

Used by the checkpoint tools (:mod:`fairseq_oss.tools`). No collectives, no fairseq.
"""
import io
import os
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple

import torch
from torch import _weights_only_unpickler

from fairseq_oss.checkpoint import safe_load
from fairseq_oss.checkpoint.format import CheckpointError, CheckpointReader, _first_line


_WHOLE = object()


@dataclass(frozen=True)
class Record:
    """One ``data/KEY`` record: where its bytes start in the file, and how many."""

    name: str
    offset: int
    nbytes: int
    dtype: torch.dtype


@dataclass(frozen=True)
class TensorPlace:
    """Where a tensor's values lie: its record and its element offset in it."""

    record: Record
    storage_offset: int


class CheckpointIndex:
    """Open ``path`` as an index (see the module's docstring).

    Attributes:
        obj: the checkpoint's object tree, tensors as meta tensors.
        records: ``{"data/KEY": Record}`` for every storage the pickle refers to.
        manifest: this package's manifest (per-chunk CRCs, writer), or None for a file
            that ``torch.save`` wrote.
        size: the file's size in bytes.

    Raises:
        CheckpointError: the path is missing, a directory, not a zip checkpoint (torch's
            legacy format included), truncated, its pickle does not match its checksum, or
            it holds a type that a safe load refuses.
    """

    def __init__(self, path: str):
        self.path = path
        if os.path.isdir(path):
            raise CheckpointError(f"{path}: is a directory, not a checkpoint file")
        if not os.path.exists(path):
            raise CheckpointError(f"{path}: no such file")
        with open(path, "rb") as f:
            head = f.read(2)
        self.size = os.path.getsize(path)
        if head[:1] == b"\x80":
            raise CheckpointError(
                f"{path}: torch's legacy (pre-1.6) format, which cannot be read without loading it whole; "
                "torch.load it and torch.save it again to convert it"
            )
        self.reader = CheckpointReader(path)  # opens the zip, reads and checks the manifest
        self._zip = self.reader._zip
        if "data.pkl" not in self._zip.get_all_records():
            raise CheckpointError(f"{path}: not a torch checkpoint (no data.pkl record)")
        self.manifest: Optional[Dict] = self.reader.manifest
        self.records: Dict[str, Record] = {}
        self._by_storage: Dict[int, Record] = {}
        pickled = bytes(self._zip.get_record("data.pkl"))
        self.reader.verify_bytes("data.pkl", pickled)  # nothing is read from a damaged pickle
        self.obj = self._unpickle(pickled)

    def _unpickle(self, data: bytes):
        safe_load.allow_fairseq_types()
        unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(data), encoding="utf-8")
        unpickler.persistent_load = self._storage
        try:
            return unpickler.load()
        except Exception as e:  # noqa: BLE001
            refused = safe_load.refusal(self.path, e) if not safe_load.trusted() else None
            detail = _first_line(e)
            detail = f" ({detail})" if any(c.isalpha() for c in detail) else ""  # not a bare memo number
            raise CheckpointError(refused or f"{self.path}: its pickle (record data.pkl) cannot be read{detail}: "
                                  "the file is damaged, or was not written by torch.save") from None

    def _storage(self, saved_id):
        _, storage_type, key, _location, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        name = f"data/{key}"
        itemsize = torch._utils._element_size(dtype)
        try:
            offset = self._zip.get_record_offset(name)
        except Exception:  # noqa: BLE001
            raise CheckpointError(f"{self.path}: record {name} is missing (the file is truncated?)") from None
        record = self.records.setdefault(name, Record(name, offset, numel * itemsize, dtype))
        untyped = torch.UntypedStorage(numel * itemsize, device="meta")
        self._by_storage[untyped._cdata] = record
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)

    def place(self, t: torch.Tensor) -> TensorPlace:
        """Where meta tensor ``t`` (one of :attr:`obj`'s) lies in the file."""
        return TensorPlace(self._by_storage[t.untyped_storage()._cdata], t.storage_offset())

    def tensors(self, obj=_WHOLE, prefix: str = "") -> Iterator[Tuple[str, torch.Tensor]]:
        """Every tensor in ``obj`` (default: the whole checkpoint) with its dotted path,
        e.g. ``model.decoder.embed_tokens.weight`` or ``last_optimizer_state.state.3.exp_avg``."""
        obj = self.obj if obj is _WHOLE else obj
        if isinstance(obj, torch.Tensor):
            yield prefix, obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                yield from self.tensors(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                yield from self.tensors(v, f"{prefix}.{i}" if prefix else str(i))

    def records_of(self, obj) -> Dict[str, Record]:
        """The records that hold the values of ``obj``'s tensors, each once: tensors that
        share a storage (tied embeddings) share a record, as the file stores them."""
        out: Dict[str, Record] = {}
        for _, t in self.tensors(obj):
            record = self.place(t).record
            out.setdefault(record.name, record)
        return out

    def tensors_in(self, record: str, start: int, end: int):
        """Paths of the tensors whose values touch bytes ``[start, end)`` of ``record``."""
        out = []
        for path, t in self.tensors():
            place = self.place(t)
            if place.record.name != record:
                continue
            lo = place.storage_offset * t.element_size()
            hi = lo + _span(t) * t.element_size()
            if lo < end and start < hi:
                out.append(path)
        return out


def _span(t: torch.Tensor) -> int:
    """Elements from a tensor's first to one past its last (its storage footprint)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


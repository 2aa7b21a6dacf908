"""``fairseq-oss strip FILE -o OUT [--dtype fp16|bf16] [--in-place]``: the checkpoint
without its optimizer state (and, with ``--dtype``, its floating-point tensors cast),
streamed record by record into this package's format (per-chunk checksums, a locked
temporary, fsync, rename): memory is one chunk; nothing is left under OUT if it fails.

Every tensor keeps its storage, offset and strides (tensors that share a storage, such
as tied embeddings, still share it); storages that only the optimizer state used are
not copied. The result is a plain fairseq checkpoint without ``last_optimizer_state``:
fairseq-generate, fairseq-eval-lm, ``from_pretrained`` and ``--finetune-from-model`` load it."""
import collections
import os
import zlib

import torch

from fairseq_oss.checkpoint.format import (
    CHUNK_BYTES,
    CheckpointError,
    CheckpointWriter,
    StorageRef,
    StreamedTensor,
)
from fairseq_oss.checkpoint.index import CheckpointIndex
from fairseq_oss.tools.report import Progress, human_bytes

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
DROPPED = ("last_optimizer_state",)


def strip(src: str, out: str, dtype=None) -> int:
    """Write ``src`` without optimizer state to ``out`` (which may be ``src``: replaced
    atomically). Returns the bytes written."""
    index = CheckpointIndex(src)
    if not isinstance(index.obj, dict):
        raise CheckpointError(f"{src}: not a fairseq checkpoint (its top level is not a dict)")
    kept = {k: v for k, v in index.obj.items() if k not in DROPPED}
    needed = index.records_of(kept)
    progress = Progress(f"strip {src}", sum(r.nbytes for r in needed.values()))
    writer = CheckpointWriter(os.path.dirname(os.path.abspath(out)))
    try:
        refs = {}

        def replace(obj):
            if isinstance(obj, torch.Tensor):
                place = index.place(obj)
                ref = refs.get(place.record.name)
                if ref is None:
                    ref = refs[place.record.name] = _copy_record(index, writer, place.record, dtype, progress)
                return StreamedTensor(ref, place.storage_offset, obj.shape, obj.stride())
            if isinstance(obj, dict):
                items = [(k, replace(v)) for k, v in obj.items()]
                return collections.OrderedDict(items) if isinstance(obj, collections.OrderedDict) else dict(items)
            if isinstance(obj, list):
                return [replace(v) for v in obj]
            if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
                return tuple(replace(v) for v in obj)
            return obj

        writer.finish(replace(kept), out)
    except BaseException:
        writer.abort()
        raise
    finally:
        progress.close()
    return os.path.getsize(out)


def _copy_record(index, writer, record, dtype, progress) -> StorageRef:
    """Stream one storage into a new record, chunk by chunk, cast to ``dtype`` if it is
    floating point. Every byte copied is checked: each chunk against the manifest's CRC
    where the source has one, else the whole record against the zip's CRC32 (before the
    new file is committed): no checksum is ever written over bytes not verified."""
    reader = index.reader
    stock = reader.manifest is None
    crc = 0
    src_dtype = record.dtype
    out_dtype = dtype if dtype is not None and src_dtype.is_floating_point else src_dtype
    itemsize = torch._utils._element_size(src_dtype)
    numel = record.nbytes // itemsize
    ref = StorageRef(writer.new_key(), out_dtype, numel)
    step = max(1, CHUNK_BYTES // itemsize)
    buf = torch.empty(min(step, max(numel, 1)), dtype=src_dtype)
    with writer.stream(f"data/{ref.key}") as w:
        for start in range(0, numel, step):
            n = min(step, numel - start)
            part = buf[:n]
            reader.read_into(record.name, start * itemsize, (start + n) * itemsize, part, verify=True)
            if stock:
                crc = zlib.crc32(part.view(torch.uint8).numpy(), crc)
            w.write(part if out_dtype == src_dtype else part.to(out_dtype))
            progress.update(n * itemsize)
    if stock:
        held = index.tensors_in(record.name, 0, record.nbytes)
        what = f" (holds {', '.join(held[:3])}{', ...' if len(held) > 3 else ''})" if held else ""
        reader.check_zip_crc(record.name, crc, what)
    return ref


def run(args) -> int:
    src = args.file
    if args.in_place and args.output:
        raise CheckpointError("give either -o OUT or --in-place, not both")
    if not args.in_place and not args.output:
        raise CheckpointError("give -o OUT (a new file), or --in-place to replace FILE")
    out = src if args.in_place else args.output
    if not args.in_place:
        parent = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(parent):
            raise CheckpointError(f"{parent}: no such directory (strip creates no directories)")
        if os.path.isdir(out):
            raise CheckpointError(f"{out}: is a directory; give the new file's path")
        if os.path.lexists(out):
            raise CheckpointError(f"{out}: exists; strip never overwrites a file (use another name, or --in-place)")
    before = os.path.getsize(src) if os.path.isfile(src) else 0
    after = strip(src, out, DTYPES[args.dtype] if args.dtype else None)
    saved = before - after
    print(f"{out}: {human_bytes(after)} (from {human_bytes(before)}: {human_bytes(saved)} saved, "
          f"{100 * saved / before if before else 0:.0f}%)")
    return 0

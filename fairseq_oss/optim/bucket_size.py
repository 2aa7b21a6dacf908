"""The bucket size that users set (``--oss-bucket-mb``, ``reshard-plan --bucket-mb``): one
validation for every place that takes it.

Owns what a usable bucket size is. A size is given in MiB and must be a finite number of
at least one byte. It must also not cut the parameters into more than
:data:`MAX_BUCKETS` buckets: every bucket costs collectives and bookkeeping on every step
(at a few bytes per bucket a small model becomes hundreds of thousands of buckets, and
no update completes). Pure arithmetic: no torch, no fairseq.
"""
import math
from typing import Optional

DEFAULT_BUCKET_MB = 32.0
MAX_BUCKETS = 65536


def bucket_bytes(mb, flag: str) -> int:
    """``mb`` MiB in bytes.

    Raises:
        ValueError: naming ``flag`` and the value, for a value that is not a finite
            number of at least one byte (nan, inf, zero, negative, under a byte).
    """
    try:
        value = float(mb)
    except (TypeError, ValueError):
        value = math.nan
    nbytes = int(value * 2**20) if math.isfinite(value) else 0
    if nbytes < 1:
        raise ValueError(f"{flag} must be a finite size of at least one byte ({1 / 2**20:.1e} MiB), got {mb}")
    return nbytes


def count_refusal(count: int, total_bytes: int, mb, flag: str) -> Optional[str]:
    """Why a layout of ``count`` buckets (of ``total_bytes`` of parameters, at ``flag``
    ``mb``) is refused, naming the flag, its value, the count and the smallest size that
    works; None when ``count`` is at most :data:`MAX_BUCKETS`."""
    if count <= MAX_BUCKETS:
        return None
    smallest = _round_up(total_bytes / MAX_BUCKETS / 2**20)
    return (
        f"{flag} {mb} cuts the {total_bytes / 2**20:.1f} MiB of parameters into {count:,} buckets; at most "
        f"{MAX_BUCKETS:,} are allowed (every bucket costs collectives and bookkeeping on every step): "
        f"use {flag} {smallest:.2g} or more (default {DEFAULT_BUCKET_MB:g})"
    )


def check_bucket_count(count: int, total_bytes: int, mb, flag: str) -> None:
    """Raises ValueError with :func:`count_refusal`'s message, if any."""
    refusal = count_refusal(count, total_bytes, mb, flag)
    if refusal is not None:
        raise ValueError(refusal)


def _round_up(value: float) -> float:
    """``value`` rounded up to two significant digits."""
    step = 10.0 ** (math.floor(math.log10(value)) - 1)
    return math.ceil(value / step) * step

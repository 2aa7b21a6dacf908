"""The one place where fairseq's own functions are replaced.

Owns the table of fairseq's originals and the (idempotent) installation of the
replacements that :mod:`.save_path`, :mod:`.load_path` and :mod:`.launcher` declare in
their ``PATCHES``. A replacement calls ``ORIGINAL[name]`` for what it leaves to fairseq.
"""
from typing import Callable, Dict, Iterable, Tuple

ORIGINAL: Dict[str, Callable] = {}


def apply(patches: Iterable[Tuple]) -> None:
    """Replace ``owner.name`` by each replacement, once: a later call for a name already
    replaced does nothing (registration may run more than once). A patch is ``(owner,
    name, replacement)``, its original kept as ``ORIGINAL[name]``, or ``(owner, name,
    replacement, key)``, kept as ``ORIGINAL[key]`` (for a name that another owner's patch
    uses too)."""
    for owner, name, replacement, *key in patches:
        key = key[0] if key else name
        if key not in ORIGINAL:
            ORIGINAL[key] = getattr(owner, name)
            setattr(owner, name, replacement)

"""The one place where fairseq's own functions are replaced.

Owns the table of fairseq's originals and the (idempotent) installation of the
replacements that :mod:`.save_path`, :mod:`.load_path` and :mod:`.launcher` declare in
their ``PATCHES``. A replacement calls ``ORIGINAL[name]`` for what it leaves to fairseq.
"""
from typing import Callable, Dict, Iterable, Tuple

ORIGINAL: Dict[str, Callable] = {}


def apply(patches: Iterable[Tuple[object, str, object]]) -> None:
    """Replace ``owner.name`` by each replacement, once: a later call for a name already
    replaced does nothing (registration may run more than once)."""
    for owner, name, replacement in patches:
        if name not in ORIGINAL:
            ORIGINAL[name] = getattr(owner, name)
            setattr(owner, name, replacement)

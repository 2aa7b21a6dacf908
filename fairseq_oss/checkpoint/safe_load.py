"""Loading fairseq checkpoints without running code from them.

Owns which Python types a checkpoint may hold, and the error for one that holds more.
torch >= 2.6 loads with ``weights_only=True`` by default: the unpickler builds tensors,
containers and numbers and nothing else, so a crafted file cannot run code. fairseq's
own checkpoints hold one more type, ``argparse.Namespace`` (the ``args`` of models that
fairseq configures from command-line arguments, e.g. every translation model), and so
fairseq's loads (``fairseq-generate``, ``fairseq-interactive``, ``from_pretrained``, a
resume) fail on them. :func:`allow_fairseq_types` allows exactly that type, in every
process that imports fairseq with this package installed; anything else is refused with
:func:`refusal`'s message.

The one way to load a file that holds other types is torch's own opt-in, the environment
variable ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``: for files the user trusts.
"""
import argparse
import os
import pickle
from typing import Optional

import torch

FAIRSEQ_CHECKPOINT_TYPES = (argparse.Namespace,)
TRUST_VARIABLE = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def allow_fairseq_types() -> None:
    """Let ``torch.load(weights_only=True)`` build the types fairseq checkpoints hold."""
    torch.serialization.add_safe_globals(list(FAIRSEQ_CHECKPOINT_TYPES))


def trusted() -> bool:
    """Whether the user opted out of the check (torch's variable, read as torch reads it)."""
    return os.getenv(TRUST_VARIABLE, "0").lower() in ("1", "y", "yes", "true")


def unsafe_types(path: str) -> list:
    """The types in ``path``'s pickle that a safe load refuses, found by disassembling it
    (nothing is executed); [] for a file that is not a zip checkpoint."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - not a zip, truncated: other checks report it
        return []


def refusal(path: str, error: Optional[BaseException] = None) -> Optional[str]:
    """The message for a checkpoint that a safe load refuses, or None if ``error`` is not
    such a refusal (and ``path`` holds no type beyond the allowed ones)."""
    if error is not None and not isinstance(error, pickle.UnpicklingError):
        return None
    names = unsafe_types(path)
    if not names:
        if error is None:
            return None
        names = ["an object the safe unpickler does not build"]
    return (
        f"{path}: refused: it holds {', '.join(names)}, which fairseq checkpoints do not hold, "
        f"and loading it could run code. If you trust this file, set {TRUST_VARIABLE}=1 to load "
        "it without this check."
    )

"""This package's exit handlers: what a process must do as it ends (wait for the last
parameter exchange, abort a pending save, wait for the last background save).

Each runs once, when the process ends: at interpreter exit (``atexit``), or, in a rank that
the CPU launch forked (:mod:`fairseq_oss.integration.rank_start`), at the end of the rank.
A forked process leaves by ``os._exit``, which skips ``atexit``; and it must not run the
``atexit`` handlers it inherited either, which belong to the launcher's process (a
temporary directory's clean-up, a pool's shut-down: run in the rank, they would act on the
launcher's files and processes). So the rank runs these, and only these.
"""
import atexit
import logging
from typing import Callable, List

logger = logging.getLogger(__name__)

_HANDLERS: List[Callable[[], None]] = []


def register(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn()`` as this process ends (see the module's docstring); returns ``fn``, so
    that it serves as a decorator."""
    atexit.register(fn)
    _HANDLERS.append(fn)
    return fn


def run_as_forked_process_ends() -> None:
    """Run every registered handler, the last registered first (as ``atexit`` does); one
    that raises is logged and the others still run. For a forked process only, which then
    leaves by ``os._exit``: elsewhere ``atexit`` runs them."""
    for fn in reversed(_HANDLERS):
        try:
            fn()
        except Exception:
            logger.exception("exit handler %s failed", getattr(fn, "__qualname__", fn))

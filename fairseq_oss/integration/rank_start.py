"""How the CPU launch (:func:`fairseq_oss.integration.compat.call_main`) starts the ranks
of one node: forked from the launcher's process where the platform forks safely (Linux),
spawned elsewhere, as fairseq does.

A spawned rank is a new interpreter that imports torch and fairseq and rebuilds what the
launcher already has: about 4 s of CPU per rank, most of a short run on a machine of few
cores. A forked rank starts from the launcher's process as it is. Nothing CUDA-related has
run there (the CPU launch is taken only without CUDA); macOS is left to spawn, its system
libraries not being fork-safe.

A forked rank leaves by ``os._exit``, which skips ``atexit``: it runs this package's exit
handlers (:mod:`fairseq_oss.exit_handlers`: the last parameter exchange waited for, a
pending save aborted, the last background save waited for) as it ends, after torch has
reported its error, if any, to the launcher; never the ``atexit`` handlers it inherited,
which act on the launcher's own files and processes.
"""
import functools
import logging
import multiprocessing.util
import sys
from typing import Optional

import torch

from fairseq_oss import exit_handlers

logger = logging.getLogger(__name__)

START_METHOD = "fork" if sys.platform.startswith("linux") else "spawn"


def start_ranks(fn, args, nprocs: int, start_method: Optional[str] = None) -> None:
    """``fn(i, *args)`` for ``i`` in ``range(nprocs)``, each in a process of its own
    (started by ``start_method``, :data:`START_METHOD` by default), and wait for them all:
    torch's ``start_processes``, which raises in the launcher if a rank fails, after
    stopping the others."""
    start_method = start_method or START_METHOD
    logger.info("starting %d ranks (%s)", nprocs, start_method)
    if start_method == "fork":
        fn = functools.partial(_with_exit_handlers, fn)
    torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method=start_method)


def _with_exit_handlers(fn, i, *args):
    # Run by multiprocessing's own exit path in this process (its finalizers with a
    # priority, run once the target returned or raised, after torch's wrapper wrote the
    # error for the launcher), before os._exit.
    multiprocessing.util.Finalize(None, exit_handlers.run_as_forked_process_ends, exitpriority=0)
    return fn(i, *args)

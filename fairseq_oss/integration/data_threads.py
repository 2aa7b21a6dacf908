"""fairseq's background batch threads, stopped when a rank's training ends (or its process).

fairseq loads batches ahead of training on a daemon thread
(``fairseq.data.iterators.BackgroundConsumer``, behind ``--data-buffer-size``, on by
default), which runs the data loader (with ``--num-workers 0``, the collater's torch ops
too) until the epoch ends or its queue is full. Training that stops inside an epoch
(``--max-update``, ``--stop-time-hours``, an error) leaves it at work, and the interpreter
ends a daemon thread by unwinding it (``pthread_exit``) when it next takes the GIL. Inside a
torch op, which releases the GIL, that unwinding meets a C++ destructor that may not throw,
and the C++ runtime aborts the process: "terminate called without an active exception",
exit status -6 (SIGABRT, and a core file where they are on), after training and its
checkpoints are done, at random (whenever the thread is inside an op as the interpreter
ends). A forked rank leaves by ``os._exit``, which unwinds nothing; a single process, a
spawned rank and a rank that torchrun started do not.

:func:`stop_background_loaders` stops every such thread: each makes the batch it is on and
stops, its queue emptied meanwhile so that it never blocks. It runs at two points: after
each rank's ``main`` (:func:`stopping_background_loaders`, which :mod:`.launcher` wraps it in:
in a spawned rank this comes before ``multiprocessing`` ends the loader's worker processes,
which the thread may be waiting for), and at interpreter exit (``atexit``, registered on
import: a process that trains without fairseq's launcher, such as a script that calls
``fairseq_cli.train.main`` itself); the second finds nothing left where the first ran.
"""
import atexit
import logging
import queue
import threading
import time

from fairseq.data import iterators

logger = logging.getLogger(__name__)

# How long a rank waits for its batch threads to stop: one batch's making, at most.
STOP_WITHIN_S = 30.0


def _running():
    return [t for t in threading.enumerate() if isinstance(t, iterators.BackgroundConsumer) and t.is_alive()]


def _empty(q: queue.Queue) -> None:
    try:
        while True:
            q.get_nowait()
    except queue.Empty:
        pass


def stop_background_loaders(within_s: float = STOP_WITHIN_S) -> bool:
    """Stop this process's fairseq batch threads once the batch each is making is made;
    the batches they had queued are dropped. Returns whether all stopped within
    ``within_s`` seconds (one that did not is logged and left running)."""
    threads = [t for t in _running() if hasattr(t, "_max_len") and hasattr(t, "_queue")]
    for t in threads:
        t._max_len = 0  # fairseq's loop stops after its next put: "Stop if we reached the maximum length"
    deadline = time.monotonic() + within_s
    for t in threads:
        while t.is_alive() and time.monotonic() < deadline:
            _empty(t._queue)  # the put of its batch, then of its end marker, never blocks
            t.join(0.005)
    late = [t.name for t in threads if t.is_alive()]
    if late:
        logger.warning(
            "fairseq's background batch thread(s) %s did not stop within %.0f s; the process may abort "
            "as it exits (\"terminate called without an active exception\")", ", ".join(late), within_s)
    return not late


def stopping_background_loaders(main, cfg, **kwargs):
    """``main(cfg, **kwargs)``, then (returned or raised) :func:`stop_background_loaders`."""
    try:
        return main(cfg, **kwargs)
    finally:
        stop_background_loaders()


atexit.register(stop_background_loaders)

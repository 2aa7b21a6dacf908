"""A rank's exit after training (fairseq_oss/integration/data_threads.py): fairseq's
background batch thread, left making batches when training stops inside an epoch, is
stopped before the interpreter ends, which otherwise aborts the process when the thread is
inside a torch op ("terminate called without an active exception", SIGABRT)."""
import os
import sys
import threading
import time

import pytest
import torch
from fairseq.data import iterators

from fairseq_oss.integration import data_threads

from launch import BIN, ROOT, WITH_START_METHOD, attempt, ckpt, free_port, train_cmd


class Source:
    """Batches of torch ops: each takes ``op_s`` seconds of ``torch.mm``, and first takes
    one of ``allowed`` (a semaphore) where one is given."""

    def __init__(self, n, op_s=0.0, allowed=None):
        self.n, self.op_s, self.allowed, self.made = n, op_s, allowed, 0

    def __len__(self):
        return self.n

    def __iter__(self):
        a = torch.rand(64, 64)
        for i in range(self.n):
            if self.allowed is not None:
                self.allowed.acquire()
            end = time.monotonic() + self.op_s
            batch = torch.mm(a, a)
            while time.monotonic() < end:
                batch = torch.mm(a, a)
            self.made += 1
            yield batch


def _consumer(buffered):
    return next(t for t in threading.enumerate()
                if isinstance(t, iterators.BackgroundConsumer) and t._queue is buffered._queue)


@pytest.mark.parametrize("queue_size, op_s", [(2, 0.0), (100, 0.05)], ids=["blocked on a full queue", "making batches"])
def test_the_batch_thread_stops_after_the_batch_it_is_making(queue_size, op_s):
    source = Source(1000, op_s)
    buffered = iterators.BufferedIterator(queue_size, source)
    next(buffered)
    if op_s == 0:  # until it has filled its queue and made one batch more, which it waits to queue
        deadline = time.monotonic() + 30
        while source.made < 1 + queue_size + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    else:
        time.sleep(0.2)  # it is making batches
    thread = _consumer(buffered)
    made = source.made
    assert thread.is_alive()
    assert data_threads.stop_background_loaders(within_s=30)
    assert not thread.is_alive()
    if op_s == 0:  # it had made its batch and waited to queue it: it makes none after
        assert made == 1 + queue_size + 1 and source.made == made
    assert source.made < source.n  # not to the epoch's end
    assert data_threads.stop_background_loaders(within_s=30)  # nothing left: returns at once


def test_a_thread_that_does_not_stop_in_time_is_reported_and_left(caplog):
    allowed = threading.Semaphore(1)
    source = Source(1000, allowed=allowed)
    buffered = iterators.BufferedIterator(100, source)
    next(buffered)  # its second batch waits for the semaphore
    thread = _consumer(buffered)
    started = time.monotonic()
    assert not data_threads.stop_background_loaders(within_s=0.3)
    assert 0.3 <= time.monotonic() - started < 10
    assert thread.is_alive() and "did not stop within" in caplog.text
    allowed.release()  # it makes that batch and stops: told to, once
    thread.join(30)
    assert not thread.is_alive() and source.made == 2


def test_main_is_followed_by_the_stop_whether_it_returns_or_raises():
    def main(cfg, **kwargs):
        buffered = iterators.BufferedIterator(100, Source(1000, 0.01))
        next(buffered)
        main.thread = _consumer(buffered)
        if kwargs.get("fail"):
            raise ValueError("training failed")
        return cfg

    assert data_threads.stopping_background_loaders(main, "cfg") == "cfg"
    assert not main.thread.is_alive()
    with pytest.raises(ValueError, match="training failed"):
        data_threads.stopping_background_loaders(main, "cfg", fail=True)
    assert not main.thread.is_alive()


# A script that iterates fairseq's batches without fairseq's launcher, and ends while the
# batch thread is inside a torch op; this package is imported with fairseq (its hook).
WITHOUT_THE_LAUNCHER = """
import sys, time, torch
from fairseq.data import iterators

class Batches:
    def __len__(self):
        return 1000

    def __iter__(self):
        a = torch.rand(64, 64)
        for _ in range(1000):
            end = time.monotonic() + 0.05
            while time.monotonic() < end:
                torch.mm(a, a)
            yield a

buffered = iterators.BufferedIterator(100, Batches())
next(buffered)
time.sleep(0.2)
print("plugin imported:", "fairseq_oss.integration.data_threads" in sys.modules, flush=True)
"""


def test_a_process_that_ends_without_the_launcher_stops_the_thread_at_exit():
    """The atexit stop: exit 0 (without it the interpreter ends the thread inside torch.mm
    and the process aborts)."""
    rc, out = attempt([sys.executable, "-c", WITHOUT_THE_LAUNCHER])
    assert "plugin imported: True" in out, out[-3000:]
    assert rc == 0 and "terminate called" not in out, (rc, out[-3000:])


SLOW_BATCHES = ["--user-dir", os.path.join(ROOT, "tests", "plugins", "slow_batches"), "--task", "lm_slow_batches"]


@pytest.mark.parametrize("optimizer, world_size, launch", [
    ("adam", 1, "fairseq"), ("oss_adam", 1, "fairseq"), ("oss_adam", 2, "torchrun"), ("adam", 3, "spawned")])
def test_training_that_ends_inside_an_epoch_exits_cleanly(data, tmp_path, optimizer, world_size, launch):
    """fairseq-train stops at --max-update while its batch thread is inside a torch op (the
    plugin makes every batch after the fourth take 2 s of them): every process exits 0,
    where each aborted without the stop. A single process, torchrun's ranks and spawned
    ranks end their interpreter (forked ranks leave by os._exit, which unwinds nothing)."""
    d = str(tmp_path / "run")
    cmd = train_cmd(data, d, optimizer, 1, 2, *SLOW_BATCHES)
    if launch == "torchrun":
        cmd = [os.path.join(BIN, "torchrun"), "--nproc-per-node", str(world_size),
               "--master-port", str(free_port()), *cmd]
    elif launch == "spawned":
        cmd = [sys.executable, "-c", WITH_START_METHOD, "spawn", *cmd[1:], "--distributed-world-size", str(world_size)]
    rc, log = attempt(cmd, timeout=300)
    assert "terminate called" not in log, log[-3000:]
    assert rc == 0, log[-3000:]
    assert "done training" in log and os.path.exists(ckpt(d))

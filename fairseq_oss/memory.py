"""Resident memory of this process, and its peak over a block: how the tests assert the
memory bounds of saving and loading, and how scripts/bench.py measures them."""
import os
import threading
import time

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    """Resident bytes of this process now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRss:
    """``with PeakRss() as m: ...``; then ``m.rise`` is the peak resident memory above the
    value at entry (sampled every millisecond by a thread) and ``m.seconds`` the wall time."""

    def __enter__(self):
        self.start = self.peak = rss()
        self._t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self._t0
        self.peak = max(self.peak, rss())
        self.rise = self.peak - self.start

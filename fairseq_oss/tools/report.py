"""Plain-text output shared by the checkpoint tools: sizes and aligned tables."""


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def print_table(rows, header, indent: int = 0) -> None:
    rows = [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]
    pad = " " * indent
    print(pad + "  ".join(str(h).ljust(w) for h, w in zip(header, widths)).rstrip())
    for r in rows:
        print(pad + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


class Progress:
    """Progress of a long pass over ``total`` bytes, on stderr: a bar on a terminal
    (tqdm), else a plain line every ``every`` seconds and one at the end."""

    def __init__(self, what: str, total: int, every: float = 5.0):
        import sys
        import time

        self._time, self._out = time.monotonic, sys.stderr
        self.what, self.total, self.done, self.every = what, total, 0, every
        self._bar = None
        self._last = self._time()
        if self._out.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="B", unit_scale=True, desc=what, file=self._out, leave=False)

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._time() - self._last >= self.every:
            self._last = self._time()
            pct = 100 * self.done / self.total if self.total else 100
            print(f"{self.what}: {pct:.0f}% ({human_bytes(self.done)} of {human_bytes(self.total)})", file=self._out)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

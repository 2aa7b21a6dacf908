"""What an independent alias (checkpoint_last.pt, checkpoint_best.pt) costs against the
hard link fairseq-oss 0.1 made: wall time of one alias and the disk it takes.

Contenders, interleaved (A B A B ...), medians over --repeats, each from a clean page
cache for writeback (``sync`` before each, outside the timed window) and with the source
file's pages in cache, as they are right after the save that wrote it:

* ``hard link``: ``os.link`` to a temporary name + rename (0.1's aliases; write-through);
* ``clone_or_copy``: this package's alias (reflink where the file system has one, else a
  kernel copy), fsync'd and renamed into place: what fairseq-train now waits for;
* ``shutil.copyfile``: stock fairseq's copy (no fsync, written through the name).

Usage: python scripts/bench_copies.py [--mb 256 1024] [--repeats 5] [--dir DIR]
"""
import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

from fairseq_oss.checkpoint.files import clone_or_copy, commit


def hard_link(src, dst):
    tmp = dst + ".link-tmp"
    os.link(src, tmp)
    commit(tmp, dst)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory under /tmp)")
    args = ap.parse_args()
    contenders = {"hard link": hard_link, "clone_or_copy": clone_or_copy, "shutil.copyfile": shutil.copyfile}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        print(f"directory {d} ({subprocess.run(['stat', '-f', '-c', '%T', d], capture_output=True, text=True).stdout.strip()})")
        print(f"{'size':>8} {'contender':>16} {'median s':>9} {'min s':>7} {'max s':>7} {'disk MiB':>9} {'how':>8}")
        for mb in args.mb:
            src = os.path.join(d, "checkpoint_1_100.pt")
            with open(src, "wb") as f:
                for _ in range(mb):
                    f.write(os.urandom(1 << 20))
            times = {name: [] for name in contenders}
            disk = {}
            how = {}
            for _ in range(args.repeats):
                for name, fn in contenders.items():
                    dst = os.path.join(d, "checkpoint_last.pt")
                    if os.path.exists(dst):
                        os.remove(dst)
                    subprocess.run(["sync"], check=True)
                    with open(src, "rb") as f:  # the source is in cache, as right after its save
                        while f.read(64 << 20):
                            pass
                    before = shutil.disk_usage(d).used
                    t0 = time.perf_counter()
                    out = fn(src, dst)
                    times[name].append(time.perf_counter() - t0)
                    subprocess.run(["sync"], check=True)
                    disk[name] = (shutil.disk_usage(d).used - before) / 2**20
                    how[name] = out if isinstance(out, str) and out in ("reflink", "copy") else "-"
            for name in contenders:
                t = times[name]
                print(f"{mb:>6}MB {name:>16} {statistics.median(t):>9.3f} {min(t):>7.3f} {max(t):>7.3f} "
                      f"{disk[name]:>9.0f} {how[name]:>8}")
            os.remove(src)


if __name__ == "__main__":
    main()

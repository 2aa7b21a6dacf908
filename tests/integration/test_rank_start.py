"""The CPU launch's ranks (fairseq_oss/integration/rank_start.py): forked on Linux, each
running this package's exit handlers (fairseq_oss/exit_handlers.py: the last parameter
exchange, a pending save, the last background save) as a spawned rank runs them at
interpreter exit, and never the exit handlers it inherited from the launcher."""
import atexit
import os
import sys
import tempfile

import pytest
import torch.multiprocessing as mp

from fairseq_oss import exit_handlers
from fairseq_oss.integration import rank_start


def _rank(i, out, fail_rank):
    exit_handlers.register(lambda: open(os.path.join(out, f"exit-handler-ran-on-rank-{i}"), "w").close())
    if i == fail_rank:
        raise ValueError(f"rank {i} failed on purpose")


def _launcher_handler(launcher_pid, out):
    if os.getpid() != launcher_pid:
        open(os.path.join(out, f"launcher-handler-ran-in-{os.getpid()}"), "w").close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks are forked on Linux only")
def test_ranks_are_forked_on_linux():
    assert rank_start.START_METHOD == "fork"


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_forked_rank_runs_its_exit_handlers(tmp_path, world_size):
    rank_start.start_ranks(_rank, (str(tmp_path), None), world_size, start_method="fork")
    assert sorted(os.listdir(tmp_path)) == [f"exit-handler-ran-on-rank-{i}" for i in range(world_size)]


def test_a_failed_rank_reports_its_error_and_runs_its_exit_handlers(tmp_path):
    """The launcher raises the rank's own error (torch's report, written before the exit
    handlers run), and the failed rank's handlers ran all the same."""
    with pytest.raises(mp.ProcessRaisedException, match="rank 0 failed on purpose"):
        rank_start.start_ranks(_rank, (str(tmp_path), 0), 1, start_method="fork")
    assert os.listdir(tmp_path) == ["exit-handler-ran-on-rank-0"]


def test_a_forked_rank_leaves_the_launchers_exit_handlers_alone(tmp_path):
    """The launcher's atexit handlers and finalizers act on its own files and processes: a
    temporary directory the launcher holds survives its ranks' ends, and a handler it
    registered runs in none of them."""
    launcher_dir = tempfile.TemporaryDirectory()
    atexit.register(_launcher_handler, os.getpid(), str(tmp_path))
    try:
        rank_start.start_ranks(_rank, (str(tmp_path), None), 2, start_method="fork")
        assert os.path.isdir(launcher_dir.name)
        assert sorted(os.listdir(tmp_path)) == [f"exit-handler-ran-on-rank-{i}" for i in range(2)]
    finally:
        atexit.unregister(_launcher_handler)
        launcher_dir.cleanup()

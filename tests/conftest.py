import os
import subprocess
import sys

import pytest

from ranks import shutdown_pools


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    """Worker pools of tests/ranks.py live for the session and are stopped at its end."""
    yield
    shutdown_pools()


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """A tiny corpus, binarized by fairseq-preprocess (scripts/make_corpus.py)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = str(tmp_path_factory.mktemp("corpus"))
    subprocess.run([sys.executable, os.path.join(root, "scripts", "make_corpus.py"), out,
                    "--vocab", "300", "--train-lines", "1500", "--valid-lines", "50"],
                   check=True, env=dict(os.environ, PYTHONWARNINGS="ignore"),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return os.path.join(out, "bin")

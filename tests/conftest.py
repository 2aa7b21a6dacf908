"""Fixtures shared by the test folders (which mirror the package's: optim, checkpoint,
integration, tools), and the quick tier.

The suite runs in two pytest-xdist worker processes (pytest.ini: a whole test file to one
worker, so that a module's fixtures are made once); what the session shares (the corpus,
the trained and resumed runs) is made once for both (``_made_once``).

The quick tier (``pytest -m quick``, README's developer loop) is every test that runs in
the test process alone (or in processes it forks for a few seconds), plus the end-to-end
tests marked ``quick`` by hand: a test is not quick if it trains through fairseq (it asks
for a corpus or a trained checkpoint) or runs ranks in the session's worker pools
(``run_ranks``).
"""
import fcntl
import inspect
import os
import shutil
import subprocess
import sys

import pytest

from launch import BIN, FIRST, RESUMED, TRANSLATION, run, train
from ranks import shutdown_pools


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    """Worker pools of tests/ranks.py live for the session and are stopped at its end."""
    yield
    shutdown_pools()


def _made_once(tmp_path_factory, name, make):
    """``(directory, what make(directory) returned)``: ``make`` writes into ``directory``
    and returns a string; it runs once per test session for ``name``, also where
    pytest-xdist runs the tests in several worker processes (pytest.ini asks for two): the
    first worker to ask makes it while holding a lock on the name; the others wait on the
    lock, then read what it returned. A ``make`` that fails leaves no result: the next to
    ask makes it again, in a fresh directory."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory, above each worker's own
    root = root / "made-once"
    root.mkdir(exist_ok=True)
    directory, result = root / name, root / f"{name}.result"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not result.exists():
            if directory.exists():
                shutil.rmtree(directory)  # a failed attempt's, made under this lock
            value = make(str(directory))
            partial = root / f"{name}.result.tmp"
            partial.write_text(value)
            os.replace(partial, result)
        return str(directory), result.read_text()


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """A tiny corpus, binarized by fairseq-preprocess (scripts/make_corpus.py)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def make(out):
        subprocess.run([sys.executable, os.path.join(root, "scripts", "make_corpus.py"), out,
                        "--vocab", "300", "--train-lines", "1500", "--valid-lines", "50"],
                       check=True, env=dict(os.environ, PYTHONWARNINGS="ignore"),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return os.path.join(out, "bin")

    return _made_once(tmp_path_factory, "corpus", make)[1]


@pytest.fixture(scope="session")
def trained(data, tmp_path_factory):
    """fairseq-train runs from scratch on the tiny corpus (launch.COMMON), each made once
    per session and shared by every test that asks for the same one:
    ``trained(optimizer, world_size)`` is its save directory after FIRST updates. Tests
    read it, or copy it before training on from it."""

    def get(optimizer, world_size):
        def make(d):
            return train(data, d, optimizer, world_size, FIRST)

        return _made_once(tmp_path_factory, f"trained-{optimizer}-{world_size}", make)[0]

    return get


@pytest.fixture(scope="session")
def resumed_run(data, trained, tmp_path_factory):
    """``resumed_run(optimizer, save_ws, load_ws)``: ``trained(optimizer, save_ws)``
    resumed by the same optimizer at ``load_ws`` ranks to RESUMED updates, made once per
    session; returns its save directory and rank 0's log. Tests read it, or copy it."""

    def get(optimizer, save_ws, load_ws):
        def make(d):
            shutil.copytree(trained(optimizer, save_ws), d)
            return train(data, d, optimizer, load_ws, RESUMED)

        return _made_once(tmp_path_factory, f"resumed-{optimizer}-{save_ws}-to-{load_ws}", make)

    return get


@pytest.fixture(scope="session")
def translation(data, tmp_path_factory):
    """A translation task (target = source reversed) binarized, and a model trained on
    it for 3 updates by oss_adam at 2 ranks."""

    def make(root):
        os.makedirs(root)
        text = os.path.dirname(data)
        for split, n in (("train", 400), ("valid", 40)):
            with open(os.path.join(text, f"{split}.txt")) as f:
                lines = [line.split() for line in f if line.strip()][:n]
            for lang, rows in (("src", lines), ("tgt", [row[::-1] for row in lines])):
                with open(os.path.join(root, f"{split}.{lang}"), "w") as f:
                    f.writelines(" ".join(r) + "\n" for r in rows)
        binary = os.path.join(root, "bin")
        run([os.path.join(BIN, "fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
             "--trainpref", os.path.join(root, "train"), "--validpref", os.path.join(root, "valid"),
             "--testpref", os.path.join(root, "valid"), "--destdir", binary, "--joined-dictionary"],
            os.path.join(root, "preprocess.log"))
        run([os.path.join(BIN, "fairseq-train"), binary, *TRANSLATION, "--save-dir", os.path.join(root, "ckpt"),
             "--max-update", "3", "--distributed-world-size", "2"], os.path.join(root, "train.log"))
        return ""

    root, _ = _made_once(tmp_path_factory, "translation", make)
    return os.path.join(root, "bin"), os.path.join(root, "ckpt"), root


# fixtures that train through fairseq-train, or make a corpus for it
_TRAINING_FIXTURES = {"data", "trained", "made", "saved", "translation", "base", "three_ranks", "short_epochs", "corpus",
                      "stock_adam_resumed"}


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the developer's loop (pytest -m quick): in-process tests and "
                                       "one end-to-end run")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("quick") is not None:
            continue
        trains = _TRAINING_FIXTURES & set(getattr(item, "fixturenames", ()))
        try:
            ranks = "run_ranks(" in inspect.getsource(item.function)
        except (OSError, TypeError):
            ranks = True
        if not trains and not ranks:
            item.add_marker(pytest.mark.quick)

"""Fixtures shared by the test folders (which mirror the package's: optim, checkpoint,
integration, tools), and the quick tier.

The quick tier (``pytest -m quick``, README's developer loop) is every test that runs in
the test process alone (or in processes it forks for a few seconds), plus the end-to-end
tests marked ``quick`` by hand: a test is not quick if it trains through fairseq (it asks
for a corpus or a trained checkpoint) or runs ranks in the session's worker pools
(``run_ranks``).
"""
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


@pytest.fixture(scope="session")
def trained(data, tmp_path_factory):
    """fairseq-train runs from scratch on the tiny corpus (launch.COMMON), each made once
    per session and shared by every test that asks for the same one:
    ``trained(optimizer, world_size)`` is its save directory after FIRST updates. Tests
    read it, or copy it before training on from it."""
    root = tmp_path_factory.mktemp("trained")
    made = {}

    def get(optimizer, world_size):
        key = optimizer, world_size
        if key not in made:
            d = str(root / f"{optimizer}-{world_size}")
            train(data, d, optimizer, world_size, FIRST)
            made[key] = d
        return made[key]

    return get


@pytest.fixture(scope="session")
def resumed_run(data, trained, tmp_path_factory):
    """``resumed_run(optimizer, save_ws, load_ws)``: ``trained(optimizer, save_ws)``
    resumed by the same optimizer at ``load_ws`` ranks to RESUMED updates, made once per
    session; returns its save directory and rank 0's log. Tests read it, or copy it."""
    root = tmp_path_factory.mktemp("resumed")
    made = {}

    def get(optimizer, save_ws, load_ws):
        key = optimizer, save_ws, load_ws
        if key not in made:
            d = str(root / f"{optimizer}-{save_ws}-to-{load_ws}")
            shutil.copytree(trained(optimizer, save_ws), d)
            made[key] = d, train(data, d, optimizer, load_ws, RESUMED)
        return made[key]

    return get


@pytest.fixture(scope="session")
def translation(data, tmp_path_factory):
    """A translation task (target = source reversed) binarized, and a model trained on
    it for 3 updates by oss_adam at 2 ranks."""
    root = str(tmp_path_factory.mktemp("translation"))
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
    save = os.path.join(root, "ckpt")
    run([os.path.join(BIN, "fairseq-train"), binary, *TRANSLATION, "--save-dir", save, "--max-update", "3",
         "--distributed-world-size", "2"], os.path.join(root, "train.log"))
    return binary, save, root


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

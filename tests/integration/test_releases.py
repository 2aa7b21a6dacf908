"""Files written by each earlier release still verify, inspect, load safely and resume.

The fixtures are checkpoints that each release's own code wrote (tests/releases.py says
how). Resuming one with oss_adam at another world size must continue exactly as stock
adam resumes it: the optimizer state crossed over bit for bit.

Assumption: fairseq on CPU is deterministic for a given seed, data and world size.
"""
import os
import shutil

import pytest
import torch

from checks import assert_same_training_state, load
from releases import MODEL, RELEASES, UPDATES, fixture, make_corpus
from launch import BIN, ENV, ckpt, run, tool


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(str(tmp_path_factory.mktemp("release-corpus")), env=ENV)


@pytest.mark.parametrize("version", sorted(RELEASES))
def test_an_earlier_release_s_file_verifies_and_inspects(version):
    rc, out, err = tool("verify", fixture(version))
    assert rc == 0 and "intact (" in out, err
    rc, out, err = tool("inspect", fixture(version))
    writer = "fairseq-oss 0.1 (its manifest names no writer)" if version == "0.1.0" else f"fairseq-oss {version}"
    assert rc == 0 and f"written by:  {writer};" in out, out
    assert f"{UPDATES} updates" in out and "(18 distinct: 1 share storage)" in out, out


@pytest.mark.parametrize("version", sorted(RELEASES))
def test_an_earlier_release_s_file_loads_with_weights_only(version):
    from fairseq_oss.checkpoint import safe_load

    safe_load.allow_fairseq_types()
    state = torch.load(fixture(version), map_location="cpu", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == UPDATES
    model = state["model"]
    assert model["decoder.embed_tokens.weight"].data_ptr() == model["decoder.output_projection.weight"].data_ptr()
    optimizer = state["last_optimizer_state"]
    assert sorted(optimizer["state"]) == optimizer["param_groups"][0]["params"] == list(range(17))


def resume(corpus, src, directory, optimizer):
    """``src`` (saved at 2 ranks) resumed by ``optimizer`` at 1 rank for 2 more updates;
    the new checkpoint."""
    os.makedirs(directory)
    shutil.copyfile(src, ckpt(directory))
    log = run([os.path.join(BIN, "fairseq-train"), corpus, *MODEL, "--optimizer", optimizer, "--save-dir", directory,
               "--max-update", str(UPDATES + 2)], os.path.join(directory, "train.log"))
    assert f"(epoch 1 @ {UPDATES} updates)" in log
    return ckpt(directory)


@pytest.fixture(scope="module")
def stock_adam_resumed(corpus, tmp_path_factory):
    return resume(corpus, fixture(max(RELEASES)), str(tmp_path_factory.mktemp("stock") / "adam"), "adam")


def test_every_release_wrote_the_same_training_state():
    """Same run, same bits, whichever release wrote it: one stock-adam resume serves as the
    reference for all."""
    newest = fixture(max(RELEASES))
    for version in RELEASES:
        assert_same_training_state(fixture(version), newest)


@pytest.mark.parametrize("version", sorted(RELEASES))
def test_an_earlier_release_s_file_resumes_as_stock_adam_resumes_it(corpus, stock_adam_resumed, tmp_path, version):
    """Saved at 2 ranks; resumed at 1 by oss_adam, 2 more updates: the same as stock adam."""
    got = resume(corpus, fixture(version), str(tmp_path / "oss_adam"), "oss_adam")
    assert load(got)["optimizer_history"][-1]["num_updates"] == UPDATES + 2
    assert_same_training_state(got, stock_adam_resumed)

"""Checkpoints written by earlier releases' own code, kept as test fixtures.

``tests/fixtures/oss_adam-VERSION.pt`` is the ``checkpoint_last.pt`` of a 2-rank
``fairseq-train --optimizer oss_adam`` run of 3 updates on a tiny model with a tied
embedding, made by the code of the commit that landed as that release
(``RELEASES``). The corpus is generated (scripts/make_corpus.py, fixed seed), so the
tests make the same one again and resume from the fixtures.

Run ``python tests/releases.py`` from the repository root (with the project's .venv
active) to write them again: each release's code is checked out in a git worktree and
put first on PYTHONPATH, so that every process of the run, spawned ranks included,
imports that release's fairseq_oss.
"""
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
RELEASES = {"0.1.0": "feaa1a3", "0.2.0": "446bf2d", "0.3.0": "9c6baf8"}
CORPUS = ["--vocab", "40", "--train-lines", "80", "--valid-lines", "10", "--seed", "1"]
MODEL = [
    "--task", "language_modeling", "--arch", "transformer_lm", "--decoder-layers", "1",
    "--decoder-embed-dim", "8", "--decoder-input-dim", "8", "--decoder-output-dim", "8",
    "--decoder-ffn-embed-dim", "16", "--decoder-attention-heads", "1",
    "--share-decoder-input-output-embed", "--tokens-per-sample", "16", "--max-tokens", "64",
    "--lr", "0.002", "--clip-norm", "0.5", "--cpu", "--seed", "1", "--no-epoch-checkpoints",
    "--disable-validation", "--log-format", "simple", "--log-interval", "1",
    "--num-workers", "0",
]
UPDATES = 3


def fixture(version: str) -> str:
    return os.path.join(FIXTURES, f"oss_adam-{version}.pt")


def make_corpus(out: str, env=None) -> str:
    """The fixtures' corpus in ``out``; returns its binarized folder."""
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_corpus.py"), out, *CORPUS],
                   check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return os.path.join(out, "bin")


def main() -> None:
    os.makedirs(FIXTURES, exist_ok=True)
    bin_dir = os.path.dirname(sys.executable)
    with tempfile.TemporaryDirectory() as tmp:
        data = make_corpus(os.path.join(tmp, "corpus"))
        for version, commit in RELEASES.items():
            tree = os.path.join(tmp, f"release-{version}")
            subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", tree, commit], check=True)
            try:
                save = os.path.join(tmp, f"save-{version}")
                env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
                subprocess.run([os.path.join(bin_dir, "fairseq-train"), data, *MODEL, "--optimizer", "oss_adam",
                                "--save-dir", save, "--max-update", str(UPDATES), "--distributed-world-size", "2"],
                               check=True, env=env, stdout=subprocess.DEVNULL)
                shutil.copyfile(os.path.join(save, "checkpoint_last.pt"), fixture(version))
                print(f"{fixture(version)}: written by fairseq-oss {version} ({commit})")
            finally:
                subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], check=True)


if __name__ == "__main__":
    main()

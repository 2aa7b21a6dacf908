"""fairseq's own tools on checkpoints that oss_adam wrote, in this environment (torch 2.13,
whose torch.load is weights_only by default; the pinned numpy): fairseq-generate and
fairseq-interactive on a translation model (its checkpoint holds an argparse.Namespace),
the hub interface's score and sample on a language model, and --sample-break-mode eos."""
import os
import subprocess
import sys

import pytest

from test_fairseq_train import BIN, ENV, ckpt, run, train

TRANSLATION = [
    "--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "1",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
    "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
    "--max-tokens", "256", "--optimizer", "oss_adam", "--lr", "0.001", "--cpu", "--seed", "1",
    "--no-epoch-checkpoints", "--log-format", "simple", "--disable-validation",
]


@pytest.fixture(scope="module")
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


def test_generate_and_interactive_load_a_translation_checkpoint(translation):
    binary, save, root = translation
    out = run([os.path.join(BIN, "fairseq-generate"), binary, "--path", ckpt(save), "--cpu",
               "--max-tokens", "256", "--beam", "2", "--gen-subset", "valid"], os.path.join(root, "generate.log"))
    assert "Generate valid with beam=2" in out and out.count("\nH-") == 40
    with open(os.path.join(root, "valid.src")) as f:
        first = f.readline()
    proc = subprocess.run([os.path.join(BIN, "fairseq-interactive"), binary, "--path", ckpt(save), "--cpu",
                           "--beam", "2", "--source-lang", "src", "--target-lang", "tgt"],
                          input=first, capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0 and "\nH-0\t" in proc.stdout, proc.stderr[-2000:]


HUB = """
import sys
from fairseq.models.transformer_lm import TransformerLanguageModel
lm = TransformerLanguageModel.from_pretrained(sys.argv[1], "checkpoint_last.pt", data_name_or_path=sys.argv[2])
lm.eval()
words = open(sys.argv[3]).readline().split()[:6]
scored = lm.score(" ".join(words))
sampled = lm.sample(" ".join(words[:2]), beam=1, sampling=True, sampling_topk=5, max_len_b=4, seed=1)
print("tokens", len(scored["tokens"]), "finite", bool(scored["positional_scores"].isfinite().all()))
print("sample", len(sampled.split()) > 2)
"""


def test_hub_score_and_sample_and_eos_break_mode(data, tmp_path):
    """A language model trained with --sample-break-mode eos (numpy's np.compat path) by
    oss_adam, then loaded through the hub interface, which scores and samples."""
    d = str(tmp_path / "lm")
    train(data, d, "oss_adam", 2, 3, extra=["--sample-break-mode", "eos"])
    proc = subprocess.run([sys.executable, "-c", HUB, d, data, os.path.join(os.path.dirname(data), "valid.txt")],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens 6 finite True" in proc.stdout and "sample True" in proc.stdout, proc.stdout


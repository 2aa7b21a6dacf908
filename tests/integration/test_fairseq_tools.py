"""fairseq's own tools on checkpoints that oss_adam wrote, in this environment (torch 2.13,
whose torch.load is weights_only by default; the pinned numpy): fairseq-generate and
fairseq-interactive on a translation model (its checkpoint holds an argparse.Namespace),
the hub interface's score and sample on a language model, and --sample-break-mode eos."""
import os
import subprocess
import sys

from launch import BIN, ENV, HUB, ckpt, run, train


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


def test_hub_score_and_sample_and_eos_break_mode(data, tmp_path):
    """A language model trained with --sample-break-mode eos (numpy's np.compat path) by
    oss_adam, then loaded through the hub interface, which scores and samples."""
    d = str(tmp_path / "lm")
    train(data, d, "oss_adam", 2, 3, extra=["--sample-break-mode", "eos"])
    proc = subprocess.run([sys.executable, "-c", HUB, d, data, os.path.join(os.path.dirname(data), "valid.txt")],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens 6 finite True" in proc.stdout and "sample True" in proc.stdout, proc.stdout


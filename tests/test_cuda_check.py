"""scripts/cuda_check.py, the GPU check, kept runnable where there is no GPU: its dry run on
CPU (the in-process reduce-scatter against fairseq's Adam, bit for bit, the step timing, and
fairseq-train at 2 ranks, oss_adam against adam) exits 0 and reports no failed check. The
GPU run itself is reported in bench-results/cuda.md."""
import os
import subprocess
import sys

from launch import ENV, ROOT


def test_dry_run_on_cpu_passes(data, tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "cuda_check.py"), data, str(tmp_path),
           "--device", "cpu", "--parts", "246"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "parameters after 6 steps equal fairseq Adam's bit for bit" in out
    assert "--fp16 layout: fp16 parameters after 5 steps equal fairseq's fp16 Adam's bit for bit" in out
    assert "fp32 checkpoint_last.pt: oss_adam equals adam bit for bit" in out
    assert "0 check(s) failed" in out and "FAIL" not in out

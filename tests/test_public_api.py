"""The public API (fairseq_oss/__init__.py, README's "Using it from Python"): every name
imports from the top-level package, importing the package alone stays cheap, and README's
example runs as written at 2 ranks."""
import os
import subprocess
import sys

import torch

from models import SMALL_BUCKET, make_model, param_groups, run_steps
from ranks import run_ranks

PUBLIC = ["ShardedAdam", "save_optimizer_state", "load_optimizer_state", "CheckpointWriter", "CheckpointReader",
          "CheckpointIndex", "CheckpointError"]


def test_every_public_name_imports_from_the_package():
    import fairseq_oss
    from fairseq_oss.tools import main

    for name in PUBLIC:
        assert getattr(fairseq_oss, name).__name__ == name
    assert callable(main)


def test_importing_the_package_imports_neither_torch_nor_fairseq():
    code = "import sys, fairseq_oss; print(sorted(m for m in ('torch', 'fairseq') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def readme_example_job(rank, world_size, directory):
    """README's example, with a small model: save at 2 ranks, load into a fresh optimizer."""
    import torch.distributed as dist

    from fairseq_oss import CheckpointWriter, ShardedAdam, load_optimizer_state, save_optimizer_state

    model = make_model()
    opt = ShardedAdam(param_groups(model, 1e-3), bucket_bytes=SMALL_BUCKET)
    run_steps(model, opt, 1, 3)
    writer = CheckpointWriter(directory) if dist.get_rank() == 0 else None
    state = save_optimizer_state(opt, writer)
    if writer is not None:
        writer.finish({"model": model.state_dict(), "last_optimizer_state": state}, os.path.join(directory, "last.pt"))
    dist.barrier()
    fresh = ShardedAdam(param_groups(model, 1e-3), bucket_bytes=SMALL_BUCKET)
    load_optimizer_state(fresh, os.path.join(directory, "last.pt"))
    return all(torch.equal(a, b) for a, b in zip(fresh._exp_avg + fresh._exp_avg_sq, opt._exp_avg + opt._exp_avg_sq))


def test_readme_example_saves_and_loads_at_two_ranks(tmp_path):
    assert run_ranks(2, readme_example_job, str(tmp_path)) == [True, True]
    state = torch.load(tmp_path / "last.pt", weights_only=True)["last_optimizer_state"]
    n = sum(len(g["params"]) for g in state["param_groups"])
    assert state["state"] and set(state["state"]) <= set(range(n))  # frozen parameters have no state
    assert max(e["step"] for e in state["state"].values()) == 3

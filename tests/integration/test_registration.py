"""How the plugin gets registered, and what that costs a process that does not use it."""
import subprocess
import sys

import pytest


def python(code):
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_the_pth_hook_imports_neither_torch_nor_fairseq():
    """Every Python process of the environment runs the package's .pth: it must stay cheap."""
    out = python("import sys; print('fairseq_oss' in sys.modules, 'torch' in sys.modules, 'fairseq' in sys.modules)")
    assert out == "True False False"


def test_importing_fairseq_registers_oss_adam_and_loads_nothing_else():
    """The hook registers oss_adam as fairseq finishes importing; what it adds to the
    process is this package's own modules and nothing more."""
    code = (
        "import sys; sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != '_RegisterAfterFairseq']\n"
        "del sys.modules['fairseq_oss']\n"  # as if the .pth had not run
        "import fairseq, fairseq_cli.train\n"
        "from fairseq.optim import OPTIMIZER_REGISTRY\n"
        "assert 'oss_adam' not in OPTIMIZER_REGISTRY\n"
        "before = set(sys.modules)\n"
        "import fairseq_oss\n"
        "added = sorted(m for m in set(sys.modules) - before if not m.startswith('fairseq_oss'))\n"
        "print('oss_adam' in OPTIMIZER_REGISTRY, added)"
    )
    assert python(code) == "True []"
    assert python("import fairseq; from fairseq.optim import OPTIMIZER_REGISTRY as R; print('oss_adam' in R)") == "True"


def test_hydra_finds_the_optimizer_group():
    code = (
        "import fairseq; from hydra.core.config_store import ConfigStore\n"
        "print('oss_adam.yaml' in ConfigStore.instance().repo['optimizer'])"
    )
    assert python(code) == "True"


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["optimizer.adam_betas=(0.9,0.98)"], ["optimizer.adam_betas='(0.9,0.98)'"]),
        (["+x.y=(1, 2)"], ["+x.y='(1, 2)'"]),
        (["optimizer.adam_betas='(0.9,0.98)'"], ["optimizer.adam_betas='(0.9,0.98)'"]),
        (["optimization.lr=[0.1]", "task.data=/a(b)", "--config-dir", "x"],
         ["optimization.lr=[0.1]", "task.data=/a(b)", "--config-dir", "x"]),
    ],
)
def test_tuple_overrides_are_quoted_for_hydra(argv, expected):
    from fairseq_oss.integration.compat import quote_tuple_overrides

    assert quote_tuple_overrides(argv) == expected


@pytest.mark.parametrize("with_model", [True, False], ids=["data-task-arch", "flags-only"])
def test_help_with_oss_adam_lists_its_flags(data, with_model):
    """fairseq's --help stops before it adds the optimizer's flags; with --optimizer oss_adam
    it lists them (adam's own and --oss-*, with their help) and exits 0."""
    import os

    from launch import BIN, ENV

    args = [data, "--task", "language_modeling", "--arch", "transformer_lm"] if with_model else []
    proc = subprocess.run([os.path.join(BIN, "fairseq-train"), *args, "--optimizer", "oss_adam", "--help"],
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = " ".join(proc.stdout.split())
    assert "--oss-grad-reduction {auto,reduce_scatter,all_reduce} how gradients are summed" in out
    assert "--adam-betas" in out and "--oss-bucket-mb" in out
    assert ("--decoder-layers" in out) == with_model

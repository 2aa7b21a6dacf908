"""The fairseq-oss command on files the tests make: real fairseq-train checkpoints
(oss_adam's and stock adam's), damaged copies, and a file much larger than the memory
bound; and what stock fairseq's tools do with a stripped checkpoint.

Assumption: the command's memory is its process's peak resident set (ru_maxrss), and a
tiny checkpoint gives the baseline (torch's import and the pickle dominate it)."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from checks import load
from launch import BIN, ENV, FIRST, HUB, ckpt, run, tool, train

@pytest.fixture(scope="module")
def made(trained):
    """Checkpoints after FIRST updates at 2 ranks: oss_adam's (manifest) and adam's (torch.save)."""
    return {opt: ckpt(trained(opt, 2)) for opt in ("oss_adam", "adam")}


@pytest.mark.parametrize("opt", ["oss_adam", "adam"])
def test_inspect_reports_what_torch_load_sees(made, opt):
    import json

    rc, out, err = tool("inspect", made[opt], "--json")
    assert rc == 0, err
    got = json.loads(out)
    want = load(made[opt])
    model = [t for t in want["model"].values() if torch.is_tensor(t)]
    assert got["model"]["parameters"] == sum(t.numel() for t in model)
    assert got["model"]["bytes"] == sum(t.numel() * t.element_size() for t in model)
    state = want["last_optimizer_state"]["state"]
    assert got["optimizer"]["entries"] == len(state)
    assert got["optimizer"]["bytes_by_key"]["exp_avg"] == sum(v["exp_avg"].numel() * 4 for v in state.values())
    assert got["optimizer"]["step"] == [FIRST, FIRST] and got["optimizer"]["name"] == "FairseqAdam"
    assert got["training"]["num_updates"] == FIRST and got["training"]["world_size"] == 2
    assert got["training"]["optimizer_config"] == opt
    if opt == "oss_adam":
        assert got["written_by"].startswith("fairseq-oss ") and got["checksums"].startswith("per 1 MiB chunk")
    else:
        assert got["written_by"].startswith("torch.save") and got["checksums"].startswith("none")
    rc, text, _ = tool("inspect", made[opt])
    assert rc == 0 and "largest tensors" in text and "decoder.embed_tokens.weight" in text


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x55]))


def _offset_of(path, name):
    from fairseq_oss.checkpoint.index import CheckpointIndex

    index = CheckpointIndex(path)
    t = dict(index.tensors())[name]
    return index.place(t).record


@pytest.mark.parametrize("opt", ["oss_adam", "adam"])
def test_verify_names_the_damaged_record_and_tensor(made, tmp_path, opt):
    good, bad = str(tmp_path / "good.pt"), str(tmp_path / "bad.pt")
    shutil.copyfile(made[opt], good)
    shutil.copyfile(made[opt], bad)
    record = _offset_of(bad, "model.decoder.embed_tokens.weight")
    _flip(bad, record.offset + record.nbytes // 2)
    rc, out, err = tool("verify", good, bad)
    assert rc == 1
    assert f"{good}: intact" in out and bad not in out
    what = "checksum mismatch" if opt == "oss_adam" else "zip CRC32 mismatch"
    assert f"{bad}: {what} in record {record.name}" in err and "model.decoder.embed_tokens.weight" in err
    if opt == "adam":
        assert "no fairseq-oss checksums" in out


@pytest.mark.parametrize("command", [["inspect"], ["verify"], ["strip", "-o", "OUT"], ["reshard-plan", "--world-size", "2"]])
@pytest.mark.parametrize("case", ["missing", "directory", "not a checkpoint", "truncated"])
def test_bad_input_gets_a_message_not_a_traceback(made, tmp_path, command, case):
    path = str(tmp_path / "input.pt")
    if case == "directory":
        os.makedirs(path)
    elif case == "not a checkpoint":
        with open(path, "w") as f:
            f.write("hello\n")
    elif case == "truncated":
        with open(made["oss_adam"], "rb") as f:
            blob = f.read()
        with open(path, "wb") as f:
            f.write(blob[: len(blob) // 2])
    args = [a.replace("OUT", str(tmp_path / "out.pt")) for a in command]
    rc, out, err = tool(args[0], path, *args[1:])
    expect = {"missing": "no such file", "directory": "is a directory",
              "not a checkpoint": "not a readable checkpoint", "truncated": "not a readable checkpoint"}[case]
    assert rc == 1 and f"{path}: {expect}" in err, err
    assert not os.path.exists(tmp_path / "out.pt")


def test_strip_drops_the_optimizer_and_keeps_the_model(made, tmp_path):
    src = made["oss_adam"]
    out = str(tmp_path / "model.pt")
    rc, text, err = tool("strip", src, "-o", out)
    assert rc == 0, err
    assert "saved" in text and os.path.getsize(out) < os.path.getsize(src) / 2
    got, want = load(out), load(src)
    assert "last_optimizer_state" not in got
    assert got["model"].keys() == want["model"].keys()
    assert all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
    assert got["optimizer_history"] == want["optimizer_history"] and got["cfg"] == want["cfg"]
    rc, _, _ = tool("verify", out)
    assert rc == 0
    half = str(tmp_path / "model-fp16.pt")
    assert tool("strip", src, "-o", half, "--dtype", "fp16")[0] == 0
    got = load(half)["model"]
    assert all(torch.equal(got[k], v.half()) for k, v in want["model"].items() if v.is_floating_point())
    # never over an existing file; --in-place replaces FILE itself
    before = open(src, "rb").read()
    rc, _, err = tool("strip", src, "-o", half)
    assert rc == 1 and "exists" in err and load(half)["model"][next(iter(want["model"]))].dtype == torch.float16
    copy = str(tmp_path / "copy.pt")
    shutil.copyfile(src, copy)
    assert tool("strip", copy, "--in-place")[0] == 0
    assert "last_optimizer_state" not in load(copy) and open(src, "rb").read() == before
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


FAILING_DISK = (
    "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (200000, 200000)); "
    "from fairseq_oss.tools import main; sys.exit(main(sys.argv[1:]))"
)


def test_strip_that_cannot_write_leaves_nothing(made, tmp_path):
    """The write fails part-way (a file-size limit stands in for a full disk): a message,
    exit 1, and no file under OUT nor a temporary left behind."""
    out = str(tmp_path / "model.pt")
    proc = subprocess.run([sys.executable, "-c", FAILING_DISK, "strip", made["adam"], "-o", out],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 1 and "File too large" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert os.listdir(tmp_path) == []


def test_strip_interrupted_leaves_nothing(made, tmp_path, monkeypatch):
    from fairseq_oss import tools
    from fairseq_oss.tools import strip

    calls = []

    def interrupt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    original = strip._copy_record
    monkeypatch.setattr(strip, "_copy_record", interrupt)
    out = str(tmp_path / "model.pt")
    assert tools.main(["strip", made["oss_adam"], "-o", out]) == 130
    assert len(calls) == 3 and os.listdir(tmp_path) == []


def test_stock_fairseq_uses_a_stripped_checkpoint(data, made, translation, tmp_path):  # noqa: F811
    """fairseq-eval-lm, from_pretrained and --finetune-from-model on a stripped language
    model; fairseq-generate on a stripped translation model."""
    d = str(tmp_path / "lm")
    os.makedirs(d)
    assert tool("strip", made["oss_adam"], "-o", ckpt(d))[0] == 0
    out = run([os.path.join(BIN, "fairseq-eval-lm"), data, "--path", ckpt(d), "--cpu", "--max-tokens", "256",
               "--tokens-per-sample", "32", "--gen-subset", "valid"], str(tmp_path / "eval.log"))
    assert "Loss (base 2):" in out
    proc = subprocess.run([sys.executable, "-c", HUB, d, data, os.path.join(os.path.dirname(data), "valid.txt")],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0 and "finite True" in proc.stdout, proc.stderr[-2000:]
    log = train(data, str(tmp_path / "finetune"), "adam", 1, 2, extra=["--finetune-from-model", ckpt(d)])
    assert "loaded checkpoint" in log.lower() and load(ckpt(str(tmp_path / "finetune")))["optimizer_history"][-1]["num_updates"] == 2
    binary, save, root = translation
    stripped = str(tmp_path / "mt.pt")
    assert tool("strip", ckpt(save), "-o", stripped, "--dtype", "fp16")[0] == 0
    out = run([os.path.join(BIN, "fairseq-generate"), binary, "--path", stripped, "--cpu", "--max-tokens", "256",
               "--beam", "2", "--gen-subset", "valid"], str(tmp_path / "generate.log"))
    assert out.count("\nH-") == 40


def test_reshard_plan_matches_the_layout(made):

    from fairseq_oss.checkpoint.index import CheckpointIndex
    from fairseq_oss.tools.reshard_plan import plan

    state = load(made["oss_adam"])["last_optimizer_state"]["state"]
    full = sum(v["exp_avg"].numel() for v in state.values()) * 4 * 2
    for world_size in (1, 3, 8):
        p = plan(CheckpointIndex(made["oss_adam"]), world_size, 1.0)
        shares = [r["adam_state_bytes"] for r in p["ranks"]]
        assert sum(shares) == full == p["full_adam_state_bytes"]
        assert max(shares) - min(shares) <= 8 * p["buckets"]  # within one element per bucket per key
    rc, out, _ = tool("reshard-plan", made["oss_adam"], "--world-size", "3")
    assert rc == 0 and "balance (largest / mean Adam state): 1.00" in out


def test_reshard_plan_of_a_stripped_file_says_so(made, tmp_path):
    out = str(tmp_path / "model.pt")
    assert tool("strip", made["oss_adam"], "-o", out)[0] == 0
    rc, _, err = tool("reshard-plan", out, "--world-size", "2")
    assert rc == 1 and "holds no optimizer state" in err


MAXRSS = (
    "import resource, sys; from fairseq_oss.tools import main; rc = main(sys.argv[1:]); "
    "print('maxrss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, file=sys.stderr); sys.exit(rc)"
)


def _peak(*args):
    proc = subprocess.run([sys.executable, "-c", MAXRSS, *args], capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stderr.rsplit("maxrss", 1)[1].split()[0])


def test_inspect_and_verify_memory_is_bounded(tmp_path):
    """A 512 MiB checkpoint (this package's format and torch.save's): inspect and verify
    stay within 48 MiB of what they take on a 1 MiB one."""
    from fairseq_oss.checkpoint.format import CheckpointWriter

    def make(path, mib, stock):
        n = mib * 2**20 // 4 // 4
        obj = {"model": {f"w{i}": torch.full((n,), float(i)) for i in range(2)},
               "last_optimizer_state": {"state": {0: {"step": 1, "exp_avg": torch.ones(n), "exp_avg_sq": torch.ones(n)}},
                                        "param_groups": [{"lr": 1.0, "params": [0]}]},
               "optimizer_history": [{"num_updates": 1, "optimizer_name": "FairseqAdam"}]}
        if stock:
            torch.save(obj, path)
        else:
            w = CheckpointWriter(str(tmp_path))
            w.finish(obj, path)

    bound = 48 * 2**20
    for stock in (False, True):
        small, big = str(tmp_path / f"small{stock}.pt"), str(tmp_path / f"big{stock}.pt")
        make(small, 1, stock)
        make(big, 512, stock)
        assert os.path.getsize(big) > 500 * 2**20
        for command in ("inspect", "verify"):
            rise = _peak(command, big) - _peak(command, small)
            assert rise < bound, (stock, command, rise / 2**20)


def test_strip_refuses_a_corrupted_stock_checkpoint(made, tmp_path):
    """One flipped bit in a weight of a stock (torch.save) checkpoint: strip exits 1 naming
    the record and the tensor, as verify does, and writes nothing: no checksum is ever
    written over bytes that were not verified. A flipped bit in its pickle likewise."""
    bad = str(tmp_path / "bad.pt")
    shutil.copyfile(made["adam"], bad)
    record = _offset_of(bad, "model.decoder.embed_tokens.weight")
    _flip(bad, record.offset + record.nbytes // 2)
    out = str(tmp_path / "out" / "model.pt")
    os.makedirs(os.path.dirname(out))
    rc, _, err = tool("strip", bad, "-o", out)
    assert rc == 1, err
    assert f"{bad}: zip CRC32 mismatch in record {record.name}" in err and "model.decoder.embed_tokens.weight" in err
    assert os.listdir(os.path.dirname(out)) == []

    pickled = str(tmp_path / "pickle.pt")
    shutil.copyfile(made["adam"], pickled)
    from fairseq_oss.checkpoint.format import CheckpointReader
    offset = CheckpointReader(pickled).record_offset("data.pkl")
    _flip(pickled, offset + 40)
    for command in (["strip", pickled, "-o", out], ["inspect", pickled]):
        rc, _, err = tool(*command)
        assert rc == 1 and f"{pickled}: zip CRC32 mismatch in record data.pkl" in err, err
    assert os.listdir(os.path.dirname(out)) == []


def test_strip_into_a_missing_directory_creates_nothing(made, tmp_path):
    out = str(tmp_path / "no" / "such" / "model.pt")
    rc, _, err = tool("strip", made["oss_adam"], "-o", out)
    assert rc == 1 and err.strip() == f"fairseq-oss strip: {tmp_path / 'no' / 'such'}: no such directory " \
                                      "(strip creates no directories)", err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("value, message", [
    ("nan", "--bucket-mb must be a finite size of at least one byte"),
    ("inf", "--bucket-mb must be a finite size of at least one byte"),
    ("0", "--bucket-mb must be a finite size of at least one byte"),
    ("1e-9", "--bucket-mb must be a finite size of at least one byte"),
    ("1e-6", "--bucket-mb 1e-06 cuts the "),
])
def test_reshard_plan_refuses_unusable_bucket_sizes(made, value, message):
    """One validation of the bucket size (fairseq_oss.optim.bucket_size) for the optimizer's flag
    and the tools: a one-line message, never a traceback (tool() asserts none)."""
    rc, out, err = tool("reshard-plan", made["oss_adam"], "--world-size", "2", "--bucket-mb", value)
    assert rc == 1 and message in err and len(err.strip().splitlines()) == 1, err
    if value == "1e-6":
        assert "buckets; at most 65,536 are allowed" in err and "use --bucket-mb " in err


def test_inspect_and_reshard_plan_count_tied_weights_once(tmp_path):
    """A tied embedding (two names, one storage) is stored once, and counted once."""
    embed, other = torch.randn(100, 8), torch.randn(8)
    model = {"decoder.embed_tokens.weight": embed, "decoder.output_projection.weight": embed, "bias": other}
    state = {i: {"step": 1, "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)} for i, n in enumerate((800, 8))}
    path = str(tmp_path / "tied.pt")
    torch.save({"model": model, "optimizer_history": [{"num_updates": 1, "optimizer_name": "FairseqAdam"}],
                "last_optimizer_state": {"state": state, "param_groups": [{"lr": 1.0, "params": [0, 1]}]}}, path)
    import json

    rc, out, err = tool("inspect", path, "--json")
    got = json.loads(out)["model"]
    assert rc == 0 and got["tensors"] == 3 and got["storages"] == 2
    assert got["bytes"] == (800 + 8) * 4 and got["parameters"] == 808
    rc, text, _ = tool("inspect", path)
    assert "808 values in 3 tensors (2 distinct: 1 share storage), 3.2 KiB" in text, text
    from fairseq_oss.checkpoint.index import CheckpointIndex
    from fairseq_oss.tools.reshard_plan import plan

    assert plan(CheckpointIndex(path), 2, 1.0)["ranks"][0]["model_bytes"] == (800 + 8) * 4


def test_read_only_commands_do_not_speak_of_writing(tmp_path):
    for command in ("inspect", "verify", "reshard-plan"):
        extra = ["--world-size", "2"] if command == "reshard-plan" else []
        rc, _, err = tool(command, str(tmp_path), *extra)
        assert rc == 1 and "written" not in err, err


def test_every_command_and_argument_is_described():
    """--help speaks to users: a description for the command and each subcommand, help for
    every argument, FILE for every checkpoint argument."""
    from fairseq_oss.tools import _parser

    p = _parser()
    assert "fairseq checkpoints" in p.description and "``" not in p.description
    sub = next(a for a in p._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    for name, parser in sub.choices.items():
        assert parser.description and len(parser.description) > 40, name
        for action in parser._actions:
            assert action.help, (name, action.dest)
            if action.dest in ("file", "files"):
                assert action.metavar == "FILE", name


def test_inspect_and_reshard_plan_count_the_ema(tmp_path):
    """--store-ema's EMA model (and a criterion's weights) are reported beside the model;
    the EMA's --ema-fp32 copies add only the storages that the EMA's own tensors do not hold
    (a float32 tensor's copy is the tensor itself); every rank holds the EMA at resume, so
    reshard-plan counts it per rank."""
    import json

    embed, bias = torch.randn(100, 8), torch.randn(8)
    model = {"embed.weight": embed, "out.weight": embed, "bias": bias}
    ema_embed, ema_half = torch.randn(100, 8), torch.randn(8).half()  # the EMA of a half-precision bias
    ema = {"embed.weight": ema_embed, "out.weight": ema_embed, "bias": ema_half}
    copies = {"embed.weight": ema_embed, "out.weight": ema_embed, "bias": ema_half.float()}
    state = {i: {"step": 1, "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)} for i, n in enumerate((800, 8))}
    ckpt = {"model": model, "optimizer_history": [{"num_updates": 1, "optimizer_name": "FairseqAdam"}],
            "last_optimizer_state": {"state": state, "param_groups": [{"lr": 1.0, "params": [0, 1]}]},
            "extra_state": {"ema": ema, "ema_fp32_params": copies}, "criterion": {"scale": torch.ones(3)}}
    path, plain = str(tmp_path / "ema.pt"), str(tmp_path / "plain.pt")
    torch.save(ckpt, path)
    torch.save({k: v for k, v in ckpt.items() if k not in ("extra_state", "criterion")}, plain)
    rc, out, err = tool("inspect", path, "--json")
    assert rc == 0, err
    got = json.loads(out)["ema"]
    assert got["tensors"] == 3 and got["storages"] == 2 and got["parameters"] == 808
    assert got["bytes"] == 800 * 4 + 8 * 2 and got["fp32_copies"] == {"tensors": 3, "bytes": 8 * 4}
    assert json.loads(out)["criterion"]["parameters"] == 3  # a criterion with parameters, beside them
    rc, text, _ = tool("inspect", path)
    assert "criterion:   3 values in 1 tensors, 12 B" in text
    assert "ema:         808 values in 3 tensors, 3.1 KiB" in text and "float32 copies (--ema-fp32): 3 tensors, 32 B more" in text, text
    rc, out, _ = tool("inspect", plain, "--json")
    assert rc == 0 and "ema" not in json.loads(out) and "criterion" not in json.loads(out)
    from fairseq_oss.checkpoint.index import CheckpointIndex
    from fairseq_oss.tools.reshard_plan import plan

    rank = plan(CheckpointIndex(path), 2, 1.0)["ranks"][1]
    assert rank["model_bytes"] == 808 * 4 and rank["ema_bytes"] == 800 * 4 + 8 * 2 + 8 * 4
    assert rank["total_bytes"] == rank["adam_state_bytes"] + rank["model_bytes"] + rank["ema_bytes"]
    assert plan(CheckpointIndex(plain), 2, 1.0)["ranks"][1]["ema_bytes"] == 0
    rc, text, _ = tool("reshard-plan", path, "--world-size", "2")
    assert rc == 0 and "the model and its EMA" in text and "EMA" in text.splitlines()[2], text

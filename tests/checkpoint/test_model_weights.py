"""The model's weights as checkpoint records (fairseq_oss.checkpoint.model_weights), in one process.

Assumptions: what loads from the records must equal what fairseq's own save holds
(``utils.move_to_cpu`` of the model's state dict: half precision as float32), with tied
tensors still sharing one storage; the ranks' shares must tile every record exactly,
whatever the world size, for the parallel write to leave no hole.
"""
import collections
import copy
import logging

import pytest
import torch

from fairseq_oss.checkpoint.format import CheckpointWriter
from fairseq_oss.checkpoint.model_weights import ModelWeights, WeightsShell, with_placeholders, with_shell
from fairseq_oss.checkpoint.save_records import stream_plans


def state_dict():
    torch.manual_seed(0)
    emb = torch.randn(50, 8)
    big = torch.randn(3000, 7)
    sd = collections.OrderedDict()
    sd["embed.weight"] = emb
    sd["proj.weight"] = emb  # tied: one storage
    sd["half.weight"] = torch.randn(33, 5).half()
    sd["bf.bias"] = torch.randn(11).bfloat16()
    sd["big.weight"] = big
    sd["big.t"] = big.t()  # a strided view of the same storage
    sd["big.row"] = big[5]  # a view at an offset
    sd["version"] = torch.tensor([3], dtype=torch.int64)
    sd["empty"] = torch.empty(0)
    sd["extra"] = {"not": "a tensor"}
    sd._metadata = collections.OrderedDict({"": {"version": 1}, "embed": {"version": 2}})
    return sd


def saved_like_fairseq(sd):
    """What fairseq's Trainer.save_checkpoint pickles of it (utils.move_to_cpu)."""
    from fairseq import utils

    return utils.move_to_cpu(sd)


def test_records_are_one_per_storage_with_half_precision_as_float32():
    w = ModelWeights.of(state_dict())
    assert [(r.numel, r.dtype) for r in w.records] == [
        (400, torch.float32), (165, torch.float32), (11, torch.float32), (21000, torch.float32),
        (1, torch.int64), (0, torch.float32)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("buffers", [(), ("t2", "t4")])
def test_shares_tile_every_record(world_size, buffers):
    """Every element of every record is written by exactly one rank; no rank writes more
    than its 1/N of the bytes that every rank holds alike plus the alignment and one
    element, and rank 0 also writes, whole, the records that ranks may hold differently."""
    sd = collections.OrderedDict((f"t{i}", torch.zeros(n, dtype=dt)) for i, (n, dt) in enumerate(
        [(1, torch.int8), (12345, torch.float32), (7, torch.float16), (0, torch.float32), (99999, torch.int64),
         (3, torch.bfloat16), (4097, torch.uint8)]))
    w = ModelWeights.of_parts({("model",): sd}, alike=lambda path, name, t: name not in buffers)
    assert [not r.alike for r in w.records] == [f"t{i}" in buffers for i in range(len(sd))]
    alike = sum(r.nbytes for r in w.records if r.alike)
    covered = [[] for _ in w.records]
    for rank in range(world_size):
        mine = 0
        for i, ranges in enumerate(w.share(rank, world_size)):
            covered[i].extend(ranges)
            mine += sum(b - a for a, b in ranges) * w.records[i].itemsize
            if not w.records[i].alike:
                assert ranges == ([(0, w.records[i].numel)] if rank == 0 else [])
        assert mine <= alike / world_size + 4096 + 8 * len(w.records) + (w.nbytes - alike if rank == 0 else 0)
    for r, ranges in zip(w.records, covered):
        at = 0
        for a, b in sorted(ranges):
            assert a == at and b > a
            at = b
        assert at == r.numel


def _write(tmp_path, sd, weights, plans):
    path = str(tmp_path / "w.pt")
    writer = CheckpointWriter(str(tmp_path))
    weights.names = stream_plans(writer, plans)
    writer.finish(with_placeholders({"model": weights.shell(saved_like_fairseq(sd)), "n": 1}, weights), path)
    return torch.load(path, weights_only=True)


def test_written_records_load_as_fairseqs_save(tmp_path):
    sd = state_dict()
    w = ModelWeights.of(sd)
    got = _write(tmp_path, sd, w, w.plans(0, 1))["model"]
    want = saved_like_fairseq(sd)
    assert list(got) == list(want) and got._metadata == sd._metadata
    for k, v in want.items():
        if torch.is_tensor(v):
            assert got[k].dtype == v.dtype and got[k].stride() == v.stride() and torch.equal(got[k], v), k
        else:
            assert got[k] == v
    assert got["embed.weight"].data_ptr() == got["proj.weight"].data_ptr()
    assert got["big.t"].untyped_storage().data_ptr() == got["big.weight"].untyped_storage().data_ptr()


def test_a_snapshot_keeps_the_weights_of_its_moment(tmp_path):
    sd = state_dict()
    w = ModelWeights.of(sd)
    snap = w.snapshot(0, 1, lambda key, t, dtype: t.to(dtype=dtype, copy=True))
    want = {k: v.clone() for k, v in saved_like_fairseq(sd).items() if torch.is_tensor(v)}
    for v in sd.values():
        if torch.is_tensor(v) and v.numel():
            v.add_(1)  # training goes on
    got = _write(tmp_path, sd, snap, snap.plans(0, 1))["model"]
    assert all(torch.equal(got[k], v) for k, v in want.items())
    with pytest.raises(ValueError, match="share"):
        snap.plans(1, 2)


def test_a_checkpoint_with_other_weights_keeps_its_own(caplog):
    sd = state_dict()
    w = ModelWeights.of(sd)
    other = collections.OrderedDict(saved_like_fairseq(sd))
    other["half.weight"] = sd["half.weight"]
    with caplog.at_level(logging.WARNING):
        assert w.shell(saved_like_fairseq(sd)) is not None
        assert w.shell(other) is None  # float16, not saved as float32
        assert w.shell({k: v for k, v in sd.items() if k != "version"}) is None
    assert "written again by rank 0" in caplog.text
    assert with_placeholders({"model": sd}, w)["model"] is sd


def test_tensors_it_cannot_describe_leave_the_model_to_rank0():
    assert ModelWeights.of({"w": torch.nn.Parameter(torch.ones(2))}) is None  # keeps requires_grad
    assert ModelWeights.of({"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)}) is None
    assert ModelWeights.of({"s": torch.ones(2).to_sparse()}) is None


EMA, EMA_FP32 = ("extra_state", "ema"), ("extra_state", "ema_fp32_params")


def ema_parts():
    """A model, its EMA (fairseq's deep copy) and the EMA's float32 copies, which fairseq's
    EMA makes by ``t.float()``: for a float32 tensor, the EMA's own tensor (one storage)."""
    model = state_dict()
    ema = copy.deepcopy(model)  # tied tensors stay tied
    ema["embed.weight"].add_(1)
    ema["big.weight"].add_(1)
    fp32 = {k: v.float() if v.is_floating_point() else v for k, v in ema.items() if torch.is_tensor(v)}
    return {("model",): model, EMA: ema, EMA_FP32: fp32}


def test_parts_at_their_paths_are_shelled_and_load_as_fairseqs_save(tmp_path):
    parts = ema_parts()
    w = ModelWeights.of_parts(parts)
    assert w.paths == [("model",), EMA, EMA_FP32]
    # the float32 copies that are the EMA's own tensors add no record
    # the model's 6; the EMA's 5 (its empty tensor is the model's empty record: no bytes); float32
    # copies of its two half-precision tensors
    assert len(w.records) == 6 + 5 + 2
    saved = {k: saved_like_fairseq(v) for k, v in parts.items()}
    ckpt = {"model": saved[("model",)], "n": 1,
            "extra_state": {"metrics": {"loss": 2.5}, "ema": saved[EMA], "ema_fp32_params": saved[EMA_FP32]}}
    shelled = with_shell(ckpt, w)
    assert shelled["extra_state"]["metrics"] == {"loss": 2.5} and ckpt["extra_state"]["ema"] is saved[EMA]
    assert not [t for t in _tensors_in(shelled)]  # rank 0 pickles none of them
    path = str(tmp_path / "w.pt")
    writer = CheckpointWriter(str(tmp_path))
    w.names = stream_plans(writer, w.plans(0, 1))
    writer.finish(with_placeholders(shelled, w), path)
    got = torch.load(path, weights_only=True)
    for name, where in (("model", ("model",)), ("ema", EMA), ("ema_fp32_params", EMA_FP32)):
        part = got["model"] if name == "model" else got["extra_state"][name]
        assert list(part) == list(saved[where]), name
        for k, v in saved[where].items():
            if torch.is_tensor(v):
                assert part[k].dtype == v.dtype and torch.equal(part[k], v), (name, k)
    assert got["extra_state"]["ema"]._metadata == parts[EMA]._metadata
    ema, fp32 = got["extra_state"]["ema"], got["extra_state"]["ema_fp32_params"]
    assert fp32["big.weight"].data_ptr() == ema["big.weight"].data_ptr()  # one storage, as torch.save keeps it
    assert got["n"] == 1 and got["extra_state"]["metrics"] == {"loss": 2.5}


def _tensors_in(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)


def test_a_part_absent_or_unlike_its_layout_is_left_to_rank0(caplog):
    parts = ema_parts()
    w = ModelWeights.of_parts(parts)
    saved = {k: saved_like_fairseq(v) for k, v in parts.items()}
    no_ema = {"model": saved[("model",)], "extra_state": {}}
    assert isinstance(with_shell(no_ema, w)["model"], WeightsShell) and with_shell(no_ema, w)["extra_state"] == {}
    other = dict(saved[EMA])
    del other["version"]
    with caplog.at_level(logging.WARNING):
        out = with_shell({"model": saved[("model",)], "extra_state": {"ema": other}}, w)
    assert "extra_state.ema is written again by rank 0" in caplog.text
    assert isinstance(out["model"], WeightsShell) and out["extra_state"]["ema"] is other
    # any part it cannot describe leaves every part to rank 0, as a model it cannot describe does
    assert ModelWeights.of_parts({("model",): parts[("model",)], EMA: {"s": torch.ones(2).to_sparse()}}) is None


def test_a_record_is_alike_only_if_every_tensor_on_it_is():
    """A storage that one entry may hold differently on each rank is rank 0's to write, under
    whatever other names (views, tied tensors, float32 copies that are the tensor itself)."""
    parts = ema_parts()
    w = ModelWeights.of_parts(parts, alike=lambda path, name, t: (path, name) != (EMA_FP32, "big.weight"))
    unlike = [i for i, r in enumerate(w.records) if not r.alike]
    assert len(unlike) == 1
    on_it = {(w.paths[e.part], e.name) for e in w.entries if e.record == unlike[0]}
    assert on_it == {(EMA, "big.weight"), (EMA, "big.t"), (EMA, "big.row"), (EMA_FP32, "big.weight"),
                     (EMA_FP32, "big.t"), (EMA_FP32, "big.row")}

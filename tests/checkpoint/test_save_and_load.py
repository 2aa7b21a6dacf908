"""The checkpoint file and the streamed save / sliced load, at 1, 2 and 3 ranks (gloo).

Assumptions: a checkpoint written by ``CheckpointWriter`` must load with plain
``torch.load`` (any mode) and hold exactly what fairseq's Adam would save; the optimizer
state it holds depends on the training state only, not on the world size that saved it.
"""
import os
import zipfile

import pytest
import torch

from checks import assert_same_state_dict
from fairseq_oss.checkpoint import load_optimizer_state, save_optimizer_state
from models import SMALL_BUCKET, build, run_steps
from ranks import run_ranks

WORLD_SIZES = [1, 2, 3]


# ---------------------------------------------------------------- single process


def test_writer_output_is_a_valid_torch_checkpoint(tmp_path):
    from fairseq_oss.checkpoint.format import CheckpointReader, CheckpointWriter, StorageRef, StreamedTensor

    path = str(tmp_path / "c.pt")
    w = CheckpointWriter(str(tmp_path))
    ref = StorageRef(w.new_key(), torch.float32, 100)
    data = torch.arange(100, dtype=torch.float32)
    with w.stream(f"data/{ref.key}") as out:
        out.write(data[:37])
        out.write(data[37:])
    emb = torch.randn(5, 3)
    obj = {"model": {"a": emb, "tied": emb, "h": torch.ones(2, dtype=torch.float16)},
           "opt": {"x": StreamedTensor(ref, 10, (3, 4)), "betas": (0.9, 0.98)}}
    w.finish(obj, path)
    assert zipfile.ZipFile(path).testzip() is None  # the zip's own CRCs are right
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    for mmap in (False, True):
        for weights_only in (True, False):
            got = torch.load(path, mmap=mmap, weights_only=weights_only)
            assert torch.equal(got["model"]["a"], emb) and torch.equal(got["opt"]["x"], data[10:22].view(3, 4))
            assert got["model"]["a"].data_ptr() == got["model"]["tied"].data_ptr()  # stored once
            assert got["model"]["h"].dtype == torch.float16 and got["opt"]["betas"] == (0.9, 0.98)
    reader = CheckpointReader(path)
    assert all(reader.record_offset(n) % 64 == 0 for n in reader.manifest["records"])
    reader.verify_all_except(set())


@pytest.mark.parametrize("sizes", [[0], [5], [2**20 - 1, 1], [3 * 2**20 + 7], [1, 2**20, 12345, 700000]])
def test_record_crc_is_combined_from_chunk_crcs(sizes):
    """The zip's CRC of a record, combined from the 1 MiB chunk CRCs, equals zlib's."""
    import zlib

    from fairseq_oss.checkpoint.format import _ChunkedCrc

    data = os.urandom(sum(sizes))
    crc, pos = _ChunkedCrc(), 0
    for n in sizes:
        crc.update(memoryview(data)[pos : pos + n])
        pos += n
    chunks = crc.close()
    assert crc.whole() == zlib.crc32(data)
    assert chunks == [zlib.crc32(data[i : i + 2**20]) for i in range(0, len(data), 2**20)]


# ---------------------------------------------------------------- multi-rank jobs


def save_job(rank, world_size, path, bucket_bytes, steps=10, parallel=False):
    """Saves as fairseq-train does: the state and the model's weights written in one pass
    (every rank its part where ``parallel``), then rank 0 pickles the rest."""
    from fairseq_oss.checkpoint.format import CheckpointWriter
    from fairseq_oss.checkpoint.model_weights import ModelWeights, with_placeholders

    model, opt, ref, ref_opt = build(bucket_bytes)
    run_steps(model, opt, 1, steps)
    run_steps(ref, ref_opt, 1, steps)
    writer = CheckpointWriter(os.path.dirname(path)) if rank == 0 else None
    weights = ModelWeights.of(model.state_dict())
    state = save_optimizer_state(opt, writer, shared_fs=parallel, weights=weights)
    if rank == 0:
        obj = {"model": weights.shell(model.state_dict()), "last_optimizer_state": state,
               "ref_optimizer": ref_opt.state_dict(), "ref_model": ref.state_dict()}
        writer.finish(with_placeholders(obj, weights), path)
        # the ranks wrote their parts themselves: every state and weight record was reserved
        return writer.reserved_records, len(opt.partition.segments()) * 2 + len(weights.records)
    return None


def resume_job(rank, world_size, path, bucket_bytes, shared_fs=True):
    model, opt, ref, ref_opt = build(bucket_bytes)
    ckpt = torch.load(path, weights_only=False)
    model.load_state_dict(ckpt["model"])
    ref.load_state_dict(ckpt["ref_model"])
    load_optimizer_state(opt, path, shared_fs=shared_fs)
    ref_opt.load_state_dict(ckpt["ref_optimizer"])
    run_steps(model, opt, 11, 15)
    run_steps(ref, ref_opt, 11, 15)
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The same training state saved, streamed, at world sizes 1, 2 and 3."""
    root = tmp_path_factory.mktemp("saved")
    paths = {}
    for ws in WORLD_SIZES:
        paths[ws] = str(root / f"ws{ws}.pt")
        run_ranks(ws, save_job, paths[ws], SMALL_BUCKET)
    return paths


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_streamed_state_is_plain_adam_state(saved, world_size):
    ckpt = torch.load(saved[world_size], weights_only=True)
    assert_same_state_dict(ckpt["last_optimizer_state"], ckpt["ref_optimizer"])


def test_same_bytes_whatever_world_size_saved(saved):
    """Deterministic: the files (optimizer state, and here everything else too) are
    byte-identical when saved at 1, 2 or 3 ranks."""
    blobs = {ws: open(p, "rb").read() for ws, p in saved.items()}
    assert blobs[1] == blobs[2] == blobs[3]


PREVIOUS_LAYOUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                               "layout-0.3.0.pt")


def records(path):
    """Every zip record of ``path``, in file order: (name, offset, bytes); the manifest
    parsed, without its ``writer`` (the version that wrote it)."""
    import json

    out = []
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            data = z.read(info)
            if info.filename.endswith("fairseq_oss.json"):
                data = {k: v for k, v in json.loads(data).items() if k != "writer"}
            out.append((info.filename, info.header_offset, data))
    return out


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_same_bytes_as_the_code_before_the_package_layout_changed(saved, world_size):
    """tests/fixtures/layout-0.3.0.pt is this test's save_job at 1 rank, run by the code of
    0.3.0 (before the package was split into optim/, checkpoint/ and integration/): what
    the code writes now, at 1, 2 and 3 ranks, is the same file, record for record and
    offset for offset, the manifest but for its writer's version."""
    assert records(saved[world_size]) == records(PREVIOUS_LAYOUT)


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_writing_its_part_gives_the_same_bytes(saved, tmp_path, world_size):
    """Each rank writes its own shard into the one file (shared file system): the file
    is byte-identical to the streamed ones, whatever the world size."""
    path = str(tmp_path / "parallel.pt")
    reserved, records = run_ranks(world_size, save_job, path, SMALL_BUCKET, 10, True)[0]
    assert reserved == records
    assert open(path, "rb").read() == open(saved[1], "rb").read()
    assert os.listdir(tmp_path) == ["parallel.pt"]


def _save_with_one_rank_blind(rank, world_size, path, bucket_bytes, blind_rank):
    """save_job with parallel=True, where ``blind_rank`` cannot open rank 0's file (it
    is on a node without the shared file system); returns rank 0's warnings."""
    import logging

    from fairseq_oss.checkpoint import parallel_write

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    parallel_write.logger.addHandler(handler)
    real = parallel_write._read_token
    if rank == blind_rank:
        def blind(path):
            raise FileNotFoundError(2, "No such file or directory", path)
        parallel_write._read_token = blind
    try:
        reserved = save_job(rank, world_size, path, bucket_bytes, 10, True)
        reserved = reserved and reserved[0]
    finally:
        parallel_write._read_token = real
        parallel_write.logger.removeHandler(handler)
    return reserved, records


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_that_cannot_see_the_file_makes_rank0_write_alone(saved, tmp_path, world_size):
    path = str(tmp_path / "fallback.pt")
    blind = world_size - 1
    reserved, logs = run_ranks(world_size, _save_with_one_rank_blind, path, SMALL_BUCKET, blind)[0]
    assert reserved == 0  # rank 0 gathered and wrote it all
    assert open(path, "rb").read() == open(saved[1], "rb").read()
    assert any(f"rank {blind} on" in m and "cannot open it" in m and "rank 0 writes the weights" in m
               for m in logs)


def _save_with_a_failing_rank(rank, world_size, path, bucket_bytes, failing_rank):
    from fairseq_oss.checkpoint import parallel_write
    from fairseq_oss.checkpoint.format import CheckpointError, CheckpointWriter

    model, opt, _, _ = build(bucket_bytes)
    run_steps(model, opt, 1, 3)
    real = parallel_write._write_own_pieces
    if rank == failing_rank:
        def full_disk(*args):
            raise OSError(28, "No space left on device")
        parallel_write._write_own_pieces = full_disk
    writer = CheckpointWriter(os.path.dirname(path)) if rank == 0 else None
    try:
        save_optimizer_state(opt, writer, shared_fs=True)
    except CheckpointError as e:
        if writer is not None:
            writer.abort()
        return str(e)
    finally:
        parallel_write._write_own_pieces = real
    return None


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_that_fails_to_write_fails_the_save_on_every_rank(tmp_path, world_size):
    failing = world_size - 1
    errors = run_ranks(world_size, _save_with_a_failing_rank, str(tmp_path / "x.pt"), SMALL_BUCKET, failing)
    assert all(e is not None and f"rank {failing} on" in e and "No space left" in e for e in errors), errors
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("save_ws, load_ws, shared_fs", [(2, 3, True), (3, 2, True), (1, 2, True),
                                                         (2, 1, True), (2, 3, False), (3, 2, False)])
def test_sliced_load_resumes_exactly(saved, save_ws, load_ws, shared_fs):
    """Each rank reads its own slices (or, without a shared file system, rank 0 sends
    them): training continues bit for bit as plain Adam's."""
    assert run_ranks(load_ws, resume_job, saved[save_ws], 2048, shared_fs) == [True] * load_ws


def _corrupt_optimizer_chunk(src, dst, which):
    """Copy src to dst with one byte flipped in the middle of the exp_avg_sq record."""
    from fairseq_oss.checkpoint.format import CheckpointReader

    reader = CheckpointReader(src)
    record = reader.manifest["optimizer_views"]["0"]["exp_avg_sq"][0]
    offset = reader.record_offset(record) + reader.manifest["records"][record]["nbytes"] * which // 4
    data = bytearray(open(src, "rb").read())
    data[offset] ^= 0xFF
    open(dst, "wb").write(bytes(data))


def load_error_job(rank, world_size, path, shared_fs=True, verify=True):
    from fairseq_oss.checkpoint.format import CheckpointError

    model, opt, _, _ = build(SMALL_BUCKET)
    before = [t.clone() for t in opt._exp_avg_sq]
    try:
        load_optimizer_state(opt, path, shared_fs=shared_fs, verify=verify)
    except CheckpointError as e:
        unchanged = all(torch.equal(a, b) for a, b in zip(before, opt._exp_avg_sq))
        return str(e), unchanged
    return None, True


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("shared_fs", [True, False])
def test_corrupted_state_fails_on_every_rank(saved, tmp_path, world_size, shared_fs):
    """A flipped byte in one rank's slice: every rank raises (none is left waiting), and
    the message names the file and the record."""
    bad = str(tmp_path / "bad.pt")
    _corrupt_optimizer_chunk(saved[2], bad, which=3)
    results = run_ranks(world_size, load_error_job, bad, shared_fs)
    for message, _ in results:
        assert message is not None and bad in message and "checksum mismatch in record data/" in message


def test_checksums_can_be_skipped(saved, tmp_path):
    """verify=False (--oss-skip-checksums) loads the same damaged file without a check."""
    bad = str(tmp_path / "bad.pt")
    _corrupt_optimizer_chunk(saved[2], bad, which=3)
    assert run_ranks(2, load_error_job, bad, True, False) == [(None, True)] * 2


@pytest.mark.parametrize("world_size", [1, 3])
def test_truncated_file_fails_on_every_rank(saved, tmp_path, world_size):
    bad = str(tmp_path / "truncated.pt")
    data = open(saved[2], "rb").read()
    open(bad, "wb").write(data[: len(data) // 2])
    results = run_ranks(world_size, load_error_job, bad)
    assert all(m is not None and bad in m and "not a readable checkpoint" in m for m, _ in results)


def mismatch_job(rank, world_size, path, kind):
    """Load into an optimizer over other parameters: one more, or another shape."""
    from fairseq_oss.checkpoint.format import CheckpointError
    from fairseq_oss.optim.sharded_adam import ShardedAdam

    from models import make_model, param_groups

    model = make_model()
    groups = param_groups(model, 1e-3)
    if kind == "count":
        groups[1]["params"].append(torch.nn.Parameter(torch.zeros(3)))
    else:
        groups[0]["params"] = [torch.nn.Parameter(torch.zeros(300, 9))]
    opt = ShardedAdam(groups, bucket_bytes=SMALL_BUCKET)
    try:
        load_optimizer_state(opt, path)
    except CheckpointError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind, message", [
    ("count", "param group 1: the checkpoint has 8 parameters, this optimizer has 9"),
    ("shape", "parameter 0: the checkpoint exp_avg has shape (300, 8), the parameter has shape (300, 9)"),
])
def test_mismatched_model_fails_on_every_rank_naming_it(saved, kind, message):
    results = run_ranks(3, mismatch_job, saved[1], kind)
    assert results == [f"{saved[1]}: {message}"] * 3


# ---------------------------------------------------------------- memory


BIG = 8_000_000  # elements: 64 MB of Adam state in all
BUCKET = 4 * 2**20


def memory_job(rank, world_size, path):
    from fairseq_oss.checkpoint.format import CheckpointWriter
    from fairseq_oss.memory import PeakRss
    from fairseq_oss.optim.sharded_adam import ShardedAdam

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(BIG // 2))
    q = torch.nn.Parameter(torch.randn(BIG // 2))
    opt = ShardedAdam([p, q], bucket_bytes=BUCKET)
    for step in range(2):
        p.grad, q.grad = torch.randn_like(p), torch.randn_like(q)
        opt.step()
    writer = CheckpointWriter(os.path.dirname(path)) if rank == 0 else None
    with PeakRss() as save:
        state = save_optimizer_state(opt, writer, shared_fs=False)
        if rank == 0:
            writer.finish({"last_optimizer_state": state}, path)
    torch.distributed.barrier()  # the file is complete before anyone reads it
    fresh = ShardedAdam([p, q], bucket_bytes=BUCKET)
    with PeakRss() as load:
        load_optimizer_state(fresh, path)
    same = all(torch.equal(a, b) for a, b in zip(fresh._exp_avg_sq, opt._exp_avg_sq))
    return save.rise, load.rise, opt.state_bytes(), same


@pytest.mark.parametrize("world_size", [2, 3])
def test_save_and_load_memory_is_bounded(tmp_path, world_size):
    """Generous hard bounds, measured on the processes: the writer's memory rises by about
    one bucket (never the full 64 MB state); a loading rank's by its own shard, not the
    whole state (plain fairseq puts all of it on every rank)."""
    path = str(tmp_path / "m.pt")
    results = run_ranks(world_size, memory_job, path)
    total_state = 2 * 4 * BIG
    for rank, (save_rise, load_rise, shard_bytes, same) in enumerate(results):
        assert same, rank
        assert save_rise <= 3 * BUCKET + 16 * 2**20, (rank, save_rise)
        assert save_rise < total_state / 2
        assert load_rise <= shard_bytes + BUCKET + 16 * 2**20, (rank, load_rise, shard_bytes)


# ---------------------------------------------------------------- mapped model weights


def _rss_file() -> int:
    """File-backed resident bytes of this process (what a mapping's touched pages add)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_mapped_pages_go_back_and_the_values_stay(tmp_path):
    """Touched pages of a mapped checkpoint count in resident memory until released;
    released pages are read again from the file, so the tensors keep their values."""
    from fairseq_oss.checkpoint.format import MappedPages, load_mmap

    torch.manual_seed(0)
    want = {f"t{i}": torch.randn(2**20) for i in range(8)}  # 32 MiB
    path = str(tmp_path / "w.pt")
    torch.save(want, path)
    got = load_mmap(path)
    before = _rss_file()
    assert all(torch.equal(got[k], want[k]) for k in want)  # reads every page
    touched = _rss_file() - before
    assert touched > 24 * 2**20, touched
    pages = MappedPages(got.values())
    assert 31 * 2**20 <= pages.nbytes <= 33 * 2**20
    pages.release()
    assert _rss_file() - before < 2 * 2**20
    assert all(torch.equal(got[k], want[k]) for k in want)  # read again from the file


def test_model_load_holds_one_module_of_mapped_weights(tmp_path):
    """Loading a model from a mapped state dict under ``releasing_mapped_weights`` holds
    about one module's pages of the file at a time (without it: all of them), and loads
    the same values."""
    from fairseq_oss.checkpoint.format import MappedPages, load_mmap
    from fairseq_oss.integration.load_path import releasing_mapped_weights
    from fairseq_oss.memory import PeakRss

    def model():
        return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])  # 4 MiB each

    torch.manual_seed(0)
    src = model()
    path = str(tmp_path / "m.pt")
    torch.save(src.state_dict(), path)
    rises = {}
    for release in (False, True):
        dst = model()
        state = load_mmap(path)
        pages = MappedPages(state.values())
        with PeakRss() as peak:
            if release:
                with releasing_mapped_weights(dst, lambda: pages):
                    dst.load_state_dict(state)
            else:
                dst.load_state_dict(state)
        rises[release] = peak.rise
        assert all(torch.equal(a, b) for a, b in zip(dst.state_dict().values(), src.state_dict().values()))
        del state
    weights = sum(t.numel() * 4 for t in src.state_dict().values())
    assert rises[False] > 0.75 * weights, rises
    assert rises[True] < 2 * weights / 8 + 2 * 2**20, rises

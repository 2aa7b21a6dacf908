"""The layout of the sharded state, in one process (no torch.distributed)."""
import pytest

from fairseq_oss.optim.partition import ParamSpec, Piece, bucket_count, bucket_onto, clip_pieces, onto, partition

F32 = "torch.float32@cpu"
DEFAULT_BUCKET_NUMEL = 32 * 2**20 // 4  # the default bucket (32 MiB) of fp32


def transformer_lm_specs(vocab=20000, dim=512, layers=6, ffn=2048):
    """Shapes of a fairseq transformer_lm, in registration order: the embedding holds
    most of the parameters."""
    numels = [vocab * dim]
    for _ in range(layers):
        numels += [dim * dim, dim] * 4  # q, k, v, out projections
        numels += [dim, dim]  # attention layer norm
        numels += [ffn * dim, ffn, dim * ffn, dim, dim, dim]  # fc1, fc2, final layer norm
    return [ParamSpec(0, n, F32) for n in numels]


def owners(part, rank):
    """Set of (param, element) that rank's shards hold."""
    out = set()
    for b in part.buckets:
        for pc in b.shard_pieces(rank):
            out.update((pc.param, pc.param_offset + k) for k in range(pc.numel))
    return out


MIXED = [
    ParamSpec(0, 7, F32),
    ParamSpec(0, 1, F32),
    ParamSpec(0, 30, F32),
    ParamSpec(0, 0, F32),
    ParamSpec(0, 5, "torch.float16@cpu"),
    ParamSpec(1, 13, F32),
    ParamSpec(1, 2, F32),
]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_numel", [1, 4, 10, 1000])
def test_every_element_has_exactly_one_owner(world_size, bucket_numel):
    part = partition(MIXED, world_size, bucket_numel)
    sets = [owners(part, r) for r in range(world_size)]
    everything = {(i, k) for i, s in enumerate(MIXED) for k in range(s.numel)}
    assert set().union(*sets) == everything
    assert sum(len(s) for s in sets) == len(everything)  # no element owned twice
    assert [part.shard_numel(r) for r in range(world_size)] == [len(s) for s in sets]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_buckets_never_mix_groups_or_kinds_and_cover_their_pieces(world_size):
    part = partition(MIXED, world_size, 10)
    for b in part.buckets:
        assert {(MIXED[pc.param].group, MIXED[pc.param].kind) for pc in b.pieces} == {(b.group, b.kind)}
        assert sum(pc.numel for pc in b.pieces) == b.numel
        offsets = [pc.offset for pc in b.pieces]
        assert offsets == sorted(offsets) and offsets[0] == 0
        # shards tile the bucket in rank order
        ranges = [b.shard_range(r) for r in range(world_size)]
        assert ranges[0][0] == 0 and ranges[-1][1] == b.numel
        assert all(ranges[r][1] == ranges[r + 1][0] for r in range(world_size - 1))
        assert max(e - s for s, e in ranges) == b.shard_numel


def test_bucket_layout_does_not_depend_on_world_size():
    """Bucket boundaries are the same at every N when the bucket size is a multiple of
    every N (here 12): the checkpoint layout never depends on N anyway, but this keeps
    the gathers of different world sizes comparable."""
    layouts = {
        n: [(b.group, b.numel, b.pieces) for b in partition(MIXED, n, 12).buckets] for n in (1, 2, 3, 4)
    }
    assert layouts[1] == layouts[2] == layouts[3] == layouts[4]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize(
    "specs",
    [
        pytest.param(transformer_lm_specs(), id="embedding-dominated"),
        pytest.param([ParamSpec(0, 44_040_193, F32)], id="one-flat-tensor"),
        pytest.param(transformer_lm_specs(vocab=50000, dim=256, layers=2), id="big-vocab-small-layers"),
    ],
)
def test_balance_within_one_percent(specs, world_size):
    """The largest rank holds at most 1.01 x total/N, with the default bucket size."""
    part = partition(specs, world_size, DEFAULT_BUCKET_NUMEL)
    total = sum(s.numel for s in specs)
    largest = max(part.shard_numel(r) for r in range(world_size))
    assert sum(part.shard_numel(r) for r in range(world_size)) == total
    assert largest <= 1.01 * total / world_size, (largest, total / world_size)


def test_whole_parameter_assignment_cannot_balance_a_dominant_embedding():
    """Why elements, not parameters: the embedding alone is over half of this model, so
    any whole-parameter assignment leaves one of 2 ranks above 1.01 x total/2."""
    specs = transformer_lm_specs(vocab=50000, dim=256, layers=2)
    total = sum(s.numel for s in specs)
    assert max(s.numel for s in specs) > 1.01 * total / 2


def test_clip_pieces_rebases_offsets():
    pieces = [Piece(0, 0, 0, 5), Piece(1, 3, 5, 10)]
    assert clip_pieces(pieces, 4, 8) == (Piece(0, 4, 0, 1), Piece(1, 3, 1, 3))
    assert clip_pieces(pieces, 15, 20) == ()


@pytest.mark.parametrize(
    "specs, world_size, bucket_numel, message",
    [
        (MIXED, 0, 10, "world_size"),
        (MIXED, 2, 0, "bucket_numel"),
        ([ParamSpec(1, 3, F32), ParamSpec(0, 3, F32)], 2, 10, "contiguous"),
    ],
)
def test_invalid_arguments_raise(specs, world_size, bucket_numel, message):
    with pytest.raises(ValueError, match=message):
        partition(specs, world_size, bucket_numel)


@pytest.mark.parametrize("world_size", [1, 3])
def test_segments_place_every_parameter_once_whatever_the_world_size(world_size):
    part = partition(MIXED, world_size, 10)
    segs = part.segments()
    placed = {p: (i, off) for i, s in enumerate(segs) for p, off in s.param_offsets}
    assert sorted(placed) == [i for i, s in enumerate(MIXED) if s.numel > 0]
    assert [s.numel for s in segs] == [38, 5, 15]  # group 0 fp32, group 0 fp16, group 1
    assert placed[2] == (0, 8) and placed[6] == (2, 13)
    assert [(s.numel, s.param_offsets) for s in segs] == [
        (s.numel, s.param_offsets) for s in partition(MIXED, 2, 1000).segments()
    ]


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("bucket_numel", [1, 7, 1000, 10**6])
def test_bucket_count_is_the_number_of_buckets_partition_makes(world_size, bucket_numel):
    specs = transformer_lm_specs(vocab=300, dim=16, layers=2, ffn=32)
    specs += [ParamSpec(1, 5, "torch.float16@cpu"), ParamSpec(1, 9, "torch.float32@cpu"), ParamSpec(2, 0, "x")]
    assert bucket_count(specs, world_size, bucket_numel) == len(partition(specs, world_size, bucket_numel).buckets)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("bucket_numel", [1, 4, 10, 1000])
def test_onto_maps_each_flat_element_to_its_tensor_element(world_size, bucket_numel):
    """fairseq's flat master: two flat parameters, each holding tensors end to end (one of
    them empty). Every element of every bucket and shard lands on the element it holds."""
    tensors = [7, 1, 0, 30, 5, 13, 2]
    layout = [[(0, 7), (1, 1), (2, 0), (3, 30)], [(4, 5), (5, 13), (6, 2)]]
    flat = [ParamSpec(0, 38, F32), ParamSpec(1, 20, F32)]
    where = {}  # (flat param, element) -> (tensor, element)
    for i, runs in enumerate(layout):
        k = 0
        for t, n in runs:
            for e in range(n):
                where[i, k] = (t, e)
                k += 1
    part = partition(flat, world_size, bucket_numel)
    seen = []
    for b in part.buckets:
        mapped = bucket_onto(b, layout)
        assert (mapped.index, mapped.numel, mapped.kind) == (b.index, b.numel, b.kind)
        for r in range(world_size):
            want = {pc.offset + k: where[pc.param, pc.param_offset + k] for pc in b.shard_pieces(r) for k in range(pc.numel)}
            got = {pc.offset + k: (pc.param, pc.param_offset + k) for pc in mapped.shard_pieces(r) for k in range(pc.numel)}
            assert got == want
            assert all(pc.numel > 0 for pc in mapped.shard_pieces(r))
            seen += list(got.values())
    assert sorted(seen) == sorted((t, e) for t, n in enumerate(tensors) for e in range(n))


def test_onto_identity_layout_changes_nothing():
    pieces = (Piece(0, 3, 0, 4), Piece(1, 0, 4, 2))
    assert onto(pieces, [[(0, 10)], [(1, 2)]]) == pieces

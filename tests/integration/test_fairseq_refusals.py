"""Settings that oss_adam cannot honour are refused with a message that names the flag
and says what to change: never a crash or a hang later. What can be told from the
configuration alone is refused before any rank is spawned, any model built or any data
read, in one line; a bucket size that the model makes unusable, once the model exists."""
import pytest

from launch import attempt, train_cmd


BEFORE_SPAWN = [
    (["--zero-sharding", "os", "--ddp-backend", "legacy_ddp"], 2,
     "--optimizer oss_adam already shards Adam's state across the data-parallel ranks; "
     "--zero-sharding os would shard it a second time. Remove --zero-sharding os"),
    (["--ddp-backend", "fully_sharded"], 2,
     "--ddp-backend fully_sharded (FSDP) already shards the optimizer state"),
    (["--oss-bucket-mb", "1e-7"], 1, "--oss-bucket-mb must be a finite size of at least one byte"),
    (["--oss-bucket-mb", "inf"], 2, "--oss-bucket-mb must be a finite size of at least one byte"),
    (["--oss-bucket-mb", "nan"], 2, "--oss-bucket-mb must be a finite size of at least one byte"),
    (["--oss-grad-reduction", "reduce_scatter", "--fp16", "--debug-param-names"], 2,
     "--oss-grad-reduction reduce_scatter does not run with --fp16 with --debug-param-names yet: "
     "use --oss-grad-reduction auto"),
]


@pytest.mark.parametrize("flags, world_size, message", BEFORE_SPAWN)
def test_refused_before_the_ranks_are_spawned_in_one_line(data, tmp_path, flags, world_size, message):
    rc, out = attempt(train_cmd(data, str(tmp_path), "oss_adam", world_size, 2, *flags), timeout=180)
    assert rc != 0, out[-3000:]
    lines = [line for line in out.splitlines() if message in line]
    assert len(lines) == 1 and lines[0].startswith("fairseq-train: error: "), out[-3000:]
    assert "Traceback" not in out and "TransformerLanguageModel" not in out and "spawn" not in out, out[-3000:]


def test_too_many_buckets_are_refused_naming_the_flag_and_the_count(data, tmp_path):
    """A bucket size of a few bytes would cut the model into hundreds of thousands of
    buckets (no update would complete): refused as the optimizer is built, before
    anything is allocated for them."""
    rc, out = attempt(train_cmd(data, str(tmp_path), "oss_adam", 2, 2, "--oss-bucket-mb", "1e-6"), timeout=180)
    assert rc != 0
    assert "--oss-bucket-mb 1e-06 cuts the 1.3 MiB of parameters into 176,304 buckets; at most 65,536 are " \
           "allowed" in out, out[-3000:]
    assert "use --oss-bucket-mb 2.1e-05 or more" in out
    assert "SIGABRT" not in out and "FairseqAdam" not in out

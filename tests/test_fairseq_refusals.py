"""Settings that oss_adam cannot honour are refused at start-up, on every rank, with a
message that names the flag and says what to change: never a crash or a hang later."""
import pytest

from test_fairseq_checkpoint import attempt, train_cmd


@pytest.mark.parametrize(
    "flags, world_size, message",
    [
        (["--zero-sharding", "os", "--ddp-backend", "legacy_ddp"], 2,
         "--optimizer oss_adam already shards Adam's state across the data-parallel ranks; "
         "--zero-sharding os would shard it a second time. Remove --zero-sharding os"),
        (["--oss-bucket-mb", "1e-7"], 1, "--oss-bucket-mb must be a finite size of at least one byte"),
        (["--oss-bucket-mb", "inf"], 1, "--oss-bucket-mb must be a finite size of at least one byte"),
    ],
)
def test_refused_with_a_message_naming_the_flag(data, tmp_path, flags, world_size, message):
    rc, out = attempt(train_cmd(data, str(tmp_path), "oss_adam", world_size, 2, *flags), timeout=180)
    assert rc != 0 and message in out, out[-3000:]
    assert "SIGABRT" not in out and "FairseqAdam" not in out

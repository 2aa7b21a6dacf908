"""Fault injection for tests/test_fairseq_checkpoint.py, loaded with --user-dir.

Driven by environment variables, so the same plugin serves every test:
- FAULT_CRASH_RANK=R, FAULT_CRASH_CALL=K: criterion ``faulty_cross_entropy`` raises on
  rank R at its K-th forward (fairseq then takes its crash.pt path on that rank only),
  after creating the file ``fault-injected-on-rank-R`` in FAULT_MARKER_DIR if that is set;
- FAULT_KILL_SAVE=N: the process writing the N-th checkpoint kills itself (SIGKILL) in the
  middle of writing a tensor record (in the background with asynchronous saves);
- FAULT_FAIL_SAVE=N: writing a tensor record of the N-th checkpoint fails with ENOSPC.
"""
import os
import signal

import torch.distributed as dist
from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig

from fairseq_oss import checkpoint_format


@register_criterion("faulty_cross_entropy", dataclass=CrossEntropyCriterionConfig)
class FaultyCrossEntropy(CrossEntropyCriterion):
    calls = 0

    def forward(self, model, sample, reduce=True):
        FaultyCrossEntropy.calls += 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == int(os.environ.get("FAULT_CRASH_RANK", -1)) and FaultyCrossEntropy.calls == int(
            os.environ.get("FAULT_CRASH_CALL", -1)
        ):
            # A file says it happened: which rank's error the launcher prints first is a
            # race (the other rank's broken connection may win it).
            marker = os.environ.get("FAULT_MARKER_DIR")
            if marker:
                open(os.path.join(marker, f"fault-injected-on-rank-{rank}"), "w").close()
            # not a RuntimeError: fairseq re-raises those before its crash path
            raise ValueError(f"injected fault on rank {rank}")
        return super().forward(model, sample, reduce)


_KILL_AT = int(os.environ.get("FAULT_KILL_SAVE", 0))
_FAIL_AT = int(os.environ.get("FAULT_FAIL_SAVE", 0))
if _KILL_AT or _FAIL_AT:
    _writers = [0]
    _init = checkpoint_format.CheckpointWriter.__init__
    _write = checkpoint_format._RecordStream.write

    def counting_init(self, *args, **kwargs):
        _writers[0] += 1
        _init(self, *args, **kwargs)

    def killing_write(self, data):
        if _writers[0] == _FAIL_AT and self.name.startswith("data/"):
            raise OSError(28, "No space left on device (injected)")
        _write(self, data)
        if _writers[0] == _KILL_AT and self.name.startswith("data/"):
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint_format.CheckpointWriter.__init__ = counting_init
    checkpoint_format._RecordStream.write = killing_write

"""Fault injection for the end-to-end tests (tests/integration/), loaded with --user-dir.

Driven by environment variables, so the same plugin serves every test:
- FAULT_CRASH_RANK=R, FAULT_CRASH_CALL=K: criterion ``faulty_cross_entropy`` raises on
  rank R at its K-th forward (fairseq then takes its crash.pt path on that rank only),
  after creating the file ``fault-injected-on-rank-R`` in FAULT_MARKER_DIR if that is set;
- FAULT_OOM=forward|backward with FAULT_CRASH_RANK and FAULT_CRASH_CALL: instead, that
  forward raises fairseq's out-of-memory error ("out of memory" in a RuntimeError), or the
  backward that follows it does, once the model's first parameter (the embedding, whose
  gradient backward completes last) has its gradient: fairseq then recovers on that rank
  (``zero_grad``, the micro-batch skipped), or tries to;
- FAULT_KILL_SAVE=N: rank 0 kills itself (SIGKILL) in the middle of writing the tensor
  records of the N-th checkpoint (in the background with asynchronous saves);
- FAULT_FAIL_SAVE=N: rank 0's writing of a tensor record of the N-th checkpoint fails
  with ENOSPC;
- FAULT_UNWRITABLE_SAVE=N: rank 0 cannot create the N-th checkpoint's file (EACCES, as in
  a directory it may not write to; root, as the tests may run, ignores permissions).
"""
import os
import signal

import torch.distributed as dist
from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig

from fairseq_oss.checkpoint import format as checkpoint_format, parallel_write


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
            oom = os.environ.get("FAULT_OOM")
            if oom == "forward":
                raise RuntimeError(f"CUDA out of memory (injected in forward on rank {rank})")
            if oom == "backward":
                out = super().forward(model, sample, reduce)
                _raise_once_when_its_gradient_is_in(next(model.parameters()), rank)
                return out
            # not a RuntimeError: fairseq re-raises those before its crash path
            raise ValueError(f"injected fault on rank {rank}")
        return super().forward(model, sample, reduce)


def _raise_once_when_its_gradient_is_in(param, rank):
    fired = []

    def hook(_):
        if not fired:
            fired.append(True)
            raise RuntimeError(f"CUDA out of memory (injected in backward on rank {rank})")

    param.register_post_accumulate_grad_hook(hook)


_KILL_AT = int(os.environ.get("FAULT_KILL_SAVE", 0))
_FAIL_AT = int(os.environ.get("FAULT_FAIL_SAVE", 0))
_DENY_AT = int(os.environ.get("FAULT_UNWRITABLE_SAVE", 0))
if _KILL_AT or _FAIL_AT or _DENY_AT:
    _writers = [0]  # checkpoints begun by this process (rank 0: the one that creates the files)
    _init = checkpoint_format.CheckpointWriter.__init__
    _write = checkpoint_format._RecordStream.write
    _pwrite_all = parallel_write._pwrite_all

    def counting_init(self, *args, **kwargs):
        _writers[0] += 1
        if _DENY_AT and _writers[0] == _DENY_AT:
            raise PermissionError(13, "Permission denied (injected)", args[0] if args else "")
        _init(self, *args, **kwargs)

    def _before_tensor_bytes():
        if _FAIL_AT and _writers[0] == _FAIL_AT:
            raise OSError(28, "No space left on device (injected)")

    def _after_tensor_bytes():
        if _KILL_AT and _writers[0] == _KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)

    def killing_write(self, data):  # rank 0 streaming a record
        if self.name.startswith("data/"):
            _before_tensor_bytes()
        _write(self, data)
        if self.name.startswith("data/"):
            _after_tensor_bytes()

    def killing_pwrite(fd, data, offset):  # a rank writing its part of a record (parallel saves)
        _before_tensor_bytes()
        _pwrite_all(fd, data, offset)
        _after_tensor_bytes()

    checkpoint_format.CheckpointWriter.__init__ = counting_init
    checkpoint_format._RecordStream.write = killing_write
    parallel_write._pwrite_all = killing_pwrite

"""Checkpoint saves that run in the background (``--write-checkpoints-asynchronously``).

Owns the snapshot a save takes, the background job that writes it, and waiting for it.
Training is blocked only while every rank copies its shards of the Adam state to CPU
memory (1/N of the state) and rank 0 copies the rest of the checkpoint (the model
weights, small entries); then each rank's job thread writes (every rank its shards,
:mod:`fairseq_oss.checkpoint.parallel_write`, or rank 0 all of it after a gather) through a gloo
process group of its own, and rank 0's thread pickles the rest, writes the manifest,
fsyncs, renames into place and makes the copies fairseq asked for
(``checkpoint_last.pt``, ...), in that order. A checkpoint therefore appears under its
final name only complete and durable; a killed job leaves the previous one untouched.

Rules kept (see :mod:`fairseq_oss.integration.save_path` for where they are called):

* one save in flight: the next save first waits for the previous job on every rank,
  and every rank raises if any rank's job failed (:func:`wait_and_agree`, collective);
* a job's failure is logged as an error by the rank it failed on, when it fails;
* the end of the process waits for the job (a non-daemon thread), and exits with status
  1 if it failed (:func:`_at_exit`);
* on fairseq's crash path (an exception being handled, maybe on one rank), the job is
  waited for without any collective.
"""
import collections
import logging
import os
import threading
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from fairseq_oss import exit_handlers
from fairseq_oss.optim import collectives, gather
from fairseq_oss.checkpoint import model_weights, save_records
from fairseq_oss.checkpoint.format import CheckpointError
from fairseq_oss.checkpoint.files import clone_or_copy

logger = logging.getLogger(__name__)


class PendingState:
    """What the optimizer's state dict holds under ``"state"`` in a checkpoint handed to
    an asynchronous save: the background job puts the written tensors' placeholders
    there before the checkpoint is pickled."""

    def __repr__(self):
        return "<optimizer state being written in the background>"


PENDING_STATE = PendingState()


class _ReusedBuffers:
    """CPU buffers kept from one save's snapshot to the next: copying into memory already
    touched costs about a fifth of copying into fresh memory (page faults), and a save
    starts only once the previous one's job is done with them. Only the buffers the
    latest save used are kept. Buffers for CUDA tensors are pinned."""

    def __init__(self):
        self._previous, self._current = {}, {}

    def begin(self) -> None:
        """A new save: buffers the last one did not use are dropped."""
        self._previous, self._current = self._current, {}

    def tensor_copy(self, key, t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A CPU copy of ``t`` (cast to ``dtype`` if given)."""
        dtype = t.dtype if dtype is None else dtype
        buf = self._previous.pop(key, None)
        if buf is None or buf.shape != t.shape or buf.dtype != dtype:
            buf = torch.empty(t.shape, dtype=dtype, pin_memory=t.is_cuda)
        self._current[key] = buf
        return buf.copy_(t)

    def storage_copy(self, storage) -> torch.UntypedStorage:
        key = ("storage", storage.data_ptr(), storage.nbytes(), str(storage.device))
        buf = self._previous.pop(key, None)
        if buf is None:
            buf = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
        self._current[key] = buf
        buf.untyped_storage().copy_(storage)
        return buf.untyped_storage()


_BUFFERS = _ReusedBuffers()


class ShardSnapshot:
    """A frozen copy, on the CPU, of what this rank writes of a save: its shards of a
    ShardedAdam's state and, if given, its part of the model's weights (its 1/N where the
    ranks write in parallel; all of them on rank 0 otherwise); with what consolidation
    and parallel writes read of the optimizer (layout, steps, parameters' shapes and
    dtypes), and a process group of its own for the background collectives."""

    def __init__(self, opt, group, weights=None, parallel: bool = False):
        self.partition, self.rank, self.world_size = opt.partition, opt.rank, opt.world_size
        self.process_group = group
        self.params = opt.params  # shapes and dtypes only
        self.steps = list(opt.steps)
        self.state_dtype = opt.state_dtype
        _BUFFERS.begin()
        self._shards = [
            (key, [_BUFFERS.tensor_copy(("shard", key, i), t.detach()) for i, t in enumerate(local)])
            for key, local in opt.state_shards()
        ]
        self.nbytes = sum(t.numel() * t.element_size() for _, local in self._shards for t in local)
        self.weights = None
        if weights is not None:
            rank, size = (self.rank, self.world_size) if parallel else (0, 1)
            self.weights = weights.snapshot(rank, size, _BUFFERS.tensor_copy)
            self.nbytes += sum(t.numel() * t.element_size() for plan in self.weights.plans(rank, size)
                               for _, t in plan.parts)
        self._opt = opt

    def state_shards(self):
        return self._shards

    def shard_ranges(self, bucket):
        return self._opt.shard_ranges(bucket)

    def state_bucket_buffers(self):
        return gather.bucket_buffers(self)


def snapshot_tensors(obj, _copies=None):
    """``obj`` with every tensor copied to the CPU and every container rebuilt, so that
    training may go on changing the originals while the copy is written. Tensors that
    share a storage (tied embeddings) still share one: the file is the one a synchronous
    save writes. Copies go into the buffers of the previous save where they fit
    (call after the save's :class:`ShardSnapshot`)."""
    copies = {} if _copies is None else _copies
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        copy = copies.get(storage._cdata)
        if copy is None:
            copy = copies[storage._cdata] = _BUFFERS.storage_copy(storage)
        return torch.empty(0, dtype=obj.dtype).set_(copy, obj.storage_offset(), obj.shape, obj.stride())
    if isinstance(obj, dict):
        items = [(k, snapshot_tensors(v, copies)) for k, v in obj.items()]
        return collections.OrderedDict(items) if isinstance(obj, collections.OrderedDict) else dict(items)
    if isinstance(obj, list):
        return [snapshot_tensors(v, copies) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(snapshot_tensors(v, copies) for v in obj)
    return obj


class BackgroundSave:
    """One rank's part of one asynchronous save, run by a (non-daemon) thread."""

    def __init__(self, snapshot: ShardSnapshot, writer, parallel: bool):
        self.snapshot, self.writer, self.parallel = snapshot, writer, parallel
        self.weights = snapshot.weights
        self.error: Optional[BaseException] = None
        self.started = time.perf_counter()
        self._handoff = threading.Event()
        self._copies_closed = threading.Event()
        self._obj = self._path = None
        self._copies: List[str] = []
        self._after_commit: List[Callable[[], None]] = []
        self.path: Optional[str] = None
        self._thread = threading.Thread(target=self._run, name="fairseq-oss-async-save", daemon=False)
        # Rank 0's job starts once it has the whole checkpoint: while rank 0 copies the
        # model, its job would only compete with it for the CPU (the other ranks' jobs
        # wait for it in their first collective).
        self._start_lock = threading.Lock()
        if writer is None:
            self._start()

    def _start(self) -> None:
        with self._start_lock:
            if self._thread.ident is None:
                self._thread.start()

    # called by the main thread (rank 0)
    def hand_off(self, obj, path: str) -> None:
        """The rest of the checkpoint and its final name: copied now (but for the weights
        already in the snapshot), written by the job."""
        obj = snapshot_tensors(model_weights.with_shell(obj, self.weights, snapshot_tensors))
        self._obj, self._path = obj, path
        self.path = os.path.abspath(path)
        self._handoff.set()
        self._start()

    def add_copy(self, dst: str) -> None:
        self._copies.append(dst)

    def after_commit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the job once the checkpoint and its copies are in place (not if
        the save fails): what fairseq does right after a synchronous save (pruning)."""
        self._after_commit.append(fn)

    def close_copies(self) -> None:
        """fairseq asked for every copy it wants of this save; also lets a job whose
        checkpoint never came (a save that raised before) end."""
        self._handoff.set()
        self._copies_closed.set()
        self._start()

    def join(self) -> None:
        self._start()
        self._thread.join()

    @property
    def running(self) -> bool:
        """The job's thread has started and not yet ended."""
        return self._thread.is_alive()

    def _run(self):
        yield_cores_to_training()
        try:
            snap, steps = self.snapshot, self.snapshot.steps
            placeholders = save_records.write(snap, self.writer, self.parallel, self.weights)
            self.snapshot = snap = None  # the shards are written: free them
            if self.writer is None:
                return
            self._handoff.wait()
            if self._obj is None:  # fairseq saved no file this time, or its save raised
                self.writer.abort()
                logger.info("oss_adam: no checkpoint was handed over to this save; its temporary file is removed")
                return
            state = {
                i: {"step": steps[i], "exp_avg": t["exp_avg"], "exp_avg_sq": t["exp_avg_sq"]}
                for i, t in sorted(placeholders.items())
            }
            for entry in _pending_entries(self._obj):
                entry["state"] = state
            self.writer.finish(model_weights.with_placeholders(self._obj, self.weights), self._path)
            self._obj = None
            self._copies_closed.wait()
            for dst in self._copies:
                clone_or_copy(self._path, dst)
            for fn in self._after_commit:
                fn()
            logger.info(
                "oss_adam: asynchronous save of %s complete (%.2f s in the background%s)", self._path,
                time.perf_counter() - self.started, f", copies: {', '.join(self._copies)}" if self._copies else "",
            )
        except BaseException as e:  # noqa: BLE001 - reported by wait_and_agree / at exit
            self.error = e
            if self.writer is not None:
                self.writer.abort()
            logger.error("oss_adam: asynchronous checkpoint save failed on this rank: %s: %s", type(e).__name__, e)


# How much lower than training's the background job's CPU priority is (nice increment of
# its thread; 0 leaves it equal). Its heavy work (CRC32s, pwrite, copies) runs in C with
# the GIL released, so on cores that training keeps busy it then takes what training
# leaves instead of competing with it.
JOB_NICE = int(os.environ.get("FAIRSEQ_OSS_ASYNC_NICE", "10"))


def yield_cores_to_training(increment: int = None) -> None:
    """Lower the calling thread's CPU priority by ``increment`` (default
    :data:`JOB_NICE`); Linux gives each thread a nice value of its own. Where that is not
    possible (another OS, a sandbox), nothing changes."""
    increment = JOB_NICE if increment is None else increment
    if increment <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except (AttributeError, OSError):
        pass


def _pending_entries(obj):
    if isinstance(obj, dict):
        if obj.get("state") is PENDING_STATE:
            yield obj
        for v in obj.values():
            yield from _pending_entries(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _pending_entries(v)


_JOB: Optional[BackgroundSave] = None
_GROUPS = {}


def background_group(group):
    """A gloo process group over ``group``'s ranks, for the jobs' collectives (created
    once per group).

    .. warning:: Collective: call on all ranks of the default group, in the same order.
    """
    key = id(group)
    if key not in _GROUPS:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        _GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo")
    return _GROUPS[key]


def begin(opt, writer, weights, group, world_size: int, shared_fs: bool) -> BackgroundSave:
    """Take this rank's snapshot (the blocking part of an asynchronous save) and start its
    job: ``opt``'s shards and, of ``weights`` (a
    :class:`~fairseq_oss.checkpoint.model_weights.ModelWeights` or None), this rank's part. Rank 0
    (``writer`` given) hands the rest of the checkpoint over later
    (:meth:`BackgroundSave.hand_off`), whose optimizer state is :func:`pending_state_dict`.

    .. warning:: Collective: call on all ranks of ``group``.
    """
    parallel = save_records.choose_parallel(opt, writer, shared_fs)
    background = background_group(group) if world_size > 1 else None
    if not parallel and writer is None:
        weights = None  # rank 0 writes them all
    job = BackgroundSave(ShardSnapshot(opt, background, weights, parallel), writer, parallel)
    start(job)
    return job


def pending_state_dict(opt) -> Dict:
    """What the optimizer's state dict is in a checkpoint handed to an asynchronous save:
    its param groups, and :data:`PENDING_STATE`, which the job replaces with the tensors
    it wrote."""
    return {"state": PENDING_STATE, "param_groups": opt.saved_param_groups()}


def start(job: BackgroundSave) -> None:
    global _JOB
    _JOB = job


def current() -> Optional[BackgroundSave]:
    return _JOB


def wait_and_agree(group, world_size: int) -> None:
    """Wait for this rank's job of the previous save, then raise on every rank if any
    rank's job failed.

    .. warning:: Collective: call on all ranks.
    """
    global _JOB
    job, _JOB = _JOB, None
    error = None
    if job is not None:
        job.close_copies()
        job.join()
        if job.error is not None:
            error = f"{type(job.error).__name__}: {job.error}"
    errors = collectives.all_gather_objects(error, group, world_size)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        r, e = failed[0]
        raise CheckpointError(
            f"the previous asynchronous checkpoint save failed (rank {r}: {e}); the checkpoint it was "
            "writing was not committed, the ones before it are intact"
        )


def wait_locally() -> Optional[BaseException]:
    """Wait for this rank's job without any collective (crash path, exit)."""
    global _JOB
    job, _JOB = _JOB, None
    if job is None:
        return None
    job.close_copies()
    job.join()
    return job.error


def _at_exit():
    error = wait_locally()
    if error is not None:
        logger.error("oss_adam: the last asynchronous checkpoint save failed (%s): exiting with status 1", error)
        logging.shutdown()
        os._exit(1)


exit_handlers.register(_at_exit)

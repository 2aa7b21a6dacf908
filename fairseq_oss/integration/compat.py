"""Fixes that make fairseq's data-parallel launchers work on CPU with gloo, and its
multi-rank resume work on torch >= 2.6. Importing this module applies them (:func:`apply`).

Owns only these patches. Each one changes behaviour only where stock fairseq fails:

===========================================  ====================================================
fairseq (``ve-fairseq`` 0.12.3)              fix, active only without CUDA unless said otherwise
===========================================  ====================================================
``_infer_single_node_init`` asserts          no device-count assertion; a free local port
``world_size <= cuda.device_count()``
``infer_init_method`` spawns                 spawn ``distributed_world_size`` processes; under
``min(cuda.device_count(), ws) = 0``         torchrun a default world size of 1 becomes
processes; under torchrun it returns         ``$WORLD_SIZE``
early for the default world size of 1
``_infer_torch_distributed_launch_init``:    ``device_id = $LOCAL_RANK``
``rank % cuda.device_count()`` divides by 0
``call_main`` spawns ``min(cuda, ws)``       starts ``distributed_num_procs`` (``rank_start``: forked on Linux)
``distributed_init`` with the default        ``gloo`` (logged)
``nccl`` backend
``DistributedDataParallel(device_ids=[0])``  ``device_ids=None`` for a module on CPU (any host)
for the default ``--ddp-backend``
``_broadcast_object_slow`` ``torch.load``    ``weights_only=False`` for the object fairseq itself
refuses DictConfig (torch >= 2.6)            pickled on rank 0 (any host)
``--fp16``'s flat fp32 master copy           the flat copy of CPU parameters on the CPU, keyed
(``build_fp32_params``) calls                by the CPU's device index (None), where fairseq's
``torch.cuda.current_device()``              gradient and parameter syncs look it up
``train_step`` on a gradient overflow        ``Tensor.cuda()`` returns the tensor itself during
(fp16) builds ``torch.tensor(0.).cuda()``    ``Trainer.train_step`` (CPU-only hosts)
===========================================  ====================================================

And one for ``fairseq-hydra-train`` only: Hydra's override grammar rejects a tuple such as
``optimizer.adam_betas=(0.9,0.98)`` (the form ``--adam-betas`` takes), so
:func:`quote_tuple_overrides` passes such a value on as the string fairseq evaluates.
"""
import contextlib
import io
import logging
import os
import re
import socket
import sys

import torch
from fairseq.distributed import utils as distributed_utils
from fairseq.models import distributed_fairseq_model
from fairseq.optim.fp16_optimizer import _FP16OptimizerMixin
from fairseq.trainer import Trainer

from fairseq_oss.integration import rank_start

logger = logging.getLogger(__name__)

_ORIGINAL = {}


def _cuda() -> bool:
    return torch.cuda.is_available()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_torchrun() -> bool:
    return all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"))


def infer_init_method(cfg, force_distributed=False):
    if _cuda():
        return _ORIGINAL["infer_init_method"](cfg, force_distributed)
    if (
        cfg.distributed_init_method is None
        and _is_torchrun()
        and cfg.distributed_world_size == 1
        and int(os.environ["WORLD_SIZE"]) > 1
    ):
        # fairseq's default world size is "all visible GPUs", which is 1 without GPUs;
        # under torchrun the launcher knows the real one.
        cfg.distributed_world_size = int(os.environ["WORLD_SIZE"])
    _ORIGINAL["infer_init_method"](cfg, force_distributed)
    if cfg.distributed_init_method is not None and not cfg.distributed_no_spawn:
        cfg.distributed_num_procs = cfg.distributed_world_size


def _infer_single_node_init(cfg):
    if _cuda():
        return _ORIGINAL["_infer_single_node_init"](cfg)
    if cfg.distributed_port <= 0:
        cfg.distributed_port = _free_port()
    cfg.distributed_init_method = f"tcp://localhost:{cfg.distributed_port}"


def _infer_torch_distributed_launch_init(cfg):
    if _cuda():
        return _ORIGINAL["_infer_torch_distributed_launch_init"](cfg)
    cfg.distributed_init_method = "env://"
    cfg.distributed_world_size = int(os.environ["WORLD_SIZE"])
    cfg.distributed_rank = int(os.environ["RANK"])
    cfg.device_id = 0  # no device to pick; fairseq would call cuda.set_device for > 0
    cfg.distributed_no_spawn = True


def call_main(cfg, main, **kwargs):
    dt = cfg.distributed_training
    if _cuda():
        return _ORIGINAL["call_main"](cfg, main, **kwargs)
    if dt.distributed_init_method is None:
        distributed_utils.infer_init_method(dt)
    if dt.distributed_init_method is None or dt.distributed_no_spawn:
        return _ORIGINAL["call_main"](cfg, main, **kwargs)
    kwargs["start_rank"] = dt.distributed_rank
    dt.distributed_rank = None  # assigned per started process
    rank_start.start_ranks(
        distributed_utils.distributed_main, (main, cfg, kwargs), dt.distributed_num_procs or dt.distributed_world_size
    )


def distributed_init(cfg):
    dt = getattr(cfg, "distributed_training", cfg)
    if not _cuda() and getattr(dt, "distributed_backend", None) == "nccl":
        logger.info("no CUDA device: using the gloo backend instead of nccl")
        dt.distributed_backend = "gloo"
    return _ORIGINAL["distributed_init"](cfg)


def _broadcast_object_slow(obj, src_rank, group, dist_device):
    """fairseq's own, with ``weights_only=False``: the object is the one fairseq pickled
    on ``src_rank`` of its own group a moment ago, a checkpoint that rank loaded safely
    (``weights_only``, :mod:`fairseq_oss.checkpoint.safe_load`), so it holds no type that could run
    code; but it holds omegaconf's config objects, which the safe unpickler does not build."""
    if distributed_utils.get_rank(group) == src_rank:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer = torch.ByteTensor(buffer.getbuffer()).to(dist_device)
        length = torch.LongTensor([len(buffer)]).to(dist_device)
        distributed_utils.broadcast(length, src=src_rank, group=group)
        distributed_utils.broadcast(buffer, src=src_rank, group=group)
        return obj
    length = torch.LongTensor([0]).to(dist_device)
    distributed_utils.broadcast(length, src=src_rank, group=group)
    buffer = torch.ByteTensor(int(length.item())).to(dist_device)
    distributed_utils.broadcast(buffer, src=src_rank, group=group)
    return torch.load(io.BytesIO(buffer.cpu().numpy()), map_location="cpu", weights_only=False)


def build_fp32_params(cls, args, params, flatten=True):
    """fairseq's, but a flat master copy of CPU parameters is built on the CPU. fairseq
    keys the flat copy by ``torch.cuda.current_device()`` and finds the parameters of
    each copy by ``p.device.index``; a CPU tensor's index is None, so the copy is keyed
    None. Same layout and values as fairseq's: the parameters in order, end to end."""
    if _cuda() or not flatten or not params or any(p.device.type != "cpu" for p in params):
        return _ORIGINAL["build_fp32_params"](args, params, flatten=flatten)
    total = sum(p.data.numel() for p in params)
    flat = params[0].new(0).float().new(total)
    offset = 0
    for p in params:
        flat[offset : offset + p.data.numel()].copy_(p.data.view(-1))
        offset += p.data.numel()
    flat = torch.nn.Parameter(flat)
    flat.grad = flat.data.new(total)
    return {params[0].device.index: flat}


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    """On a host without CUDA, ``Tensor.cuda()`` returns the tensor (for the block only)."""
    if _cuda():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def train_step(self, samples, raise_oom=False):
    """fairseq's, where the only CUDA call on a CPU run's path, the zero gradient norm
    of a step skipped for an fp16 overflow, stays on the CPU."""
    with _tensor_cuda_is_identity():
        return _ORIGINAL["train_step"](self, samples, raise_oom)


def DistributedDataParallel(module, *args, device_ids=None, output_device=None, **kwargs):
    """torch's DDP, with ``device_ids``/``output_device`` dropped for a CPU module (DDP
    requires ``None`` there; fairseq always passes ``[device_id]``)."""
    if all(p.device.type == "cpu" for p in module.parameters()):
        device_ids = output_device = None
    return _ORIGINAL["DistributedDataParallel"](
        module, *args, device_ids=device_ids, output_device=output_device, **kwargs
    )


_TUPLE_OVERRIDE = re.compile(r"^([\w.+~@/-]+)=(\(.*\))$")


def quote_tuple_overrides(argv):
    """``key=(a,b)`` becomes ``key='(a,b)'``; every other argument is kept as it is."""
    out = []
    for arg in argv:
        m = _TUPLE_OVERRIDE.match(arg)
        out.append(f"{m.group(1)}='{m.group(2)}'" if m and "'" not in arg else arg)
    return out


def _is_hydra_train() -> bool:
    prog = os.path.basename(sys.argv[0]) if sys.argv else ""
    return prog in ("fairseq-hydra-train", "hydra_train.py")


_PATCHES = [
    (distributed_utils, "infer_init_method", infer_init_method),
    (distributed_utils, "_infer_single_node_init", _infer_single_node_init),
    (distributed_utils, "_infer_torch_distributed_launch_init", _infer_torch_distributed_launch_init),
    (distributed_utils, "call_main", call_main),
    (distributed_utils, "distributed_init", distributed_init),
    (distributed_utils, "_broadcast_object_slow", _broadcast_object_slow),
    (distributed_fairseq_model, "DistributedDataParallel", DistributedDataParallel),
    (_FP16OptimizerMixin, "build_fp32_params", classmethod(build_fp32_params)),
    (Trainer, "train_step", train_step),
]


def apply() -> None:
    """Install the patches once; later calls do nothing. Importing this module calls it."""
    for module, name, replacement in _PATCHES:
        if name not in _ORIGINAL:
            _ORIGINAL[name] = getattr(module, name)
            setattr(module, name, replacement)
    if _is_hydra_train() and "quote_tuple_overrides" not in _ORIGINAL:
        _ORIGINAL["quote_tuple_overrides"] = list(sys.argv)
        sys.argv[1:] = quote_tuple_overrides(sys.argv[1:])


apply()

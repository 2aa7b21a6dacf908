"""State-dict hooks for models whose parameters are ``DTensor``s, registered by the plugin.

Owns two hooks on a module (the pitch of ``shared/seeds/sharded-tensor-hooks-issue.txt``,
done by the framework rather than the user):

* after ``state_dict()``: every ``DTensor`` value becomes its full tensor, so the
  checkpoint holds ordinary tensors whatever the mesh (``full_tensor()`` is a collective
  over the tensor's mesh: every rank of it must call ``state_dict()``);
* before ``load_state_dict()``: a full tensor loaded into a ``DTensor`` parameter or buffer
  is cut to this rank's local shard for the *current* mesh and placements, by slicing,
  without communication (every rank has the full tensor), so a checkpoint saved on one
  mesh loads on another.

With no ``DTensor`` in the module both hooks change nothing.
"""
import sys

import torch

_MARK = "_fairseq_oss_sharded_tensor_hooks"


def _dtensor_class():
    """DTensor, if torch.distributed.tensor is imported; else None. A model cannot hold a
    DTensor before that module is imported, and importing it costs a second (sympy), so
    the plugin never imports it itself."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def has_dtensor(module: torch.nn.Module) -> bool:
    dtensor = _dtensor_class()
    return dtensor is not None and any(
        isinstance(t, dtensor) for t in list(module.parameters()) + list(module.buffers())
    )


def register_sharded_tensor_hooks(module: torch.nn.Module) -> None:
    """Register both hooks on ``module`` (once; later calls do nothing)."""
    if getattr(module, _MARK, False):
        return
    module._register_state_dict_hook(_full_tensors)
    module._register_load_state_dict_pre_hook(_local_shards, with_module=True)
    setattr(module, _MARK, True)


def _full_tensors(module, state_dict, prefix, local_metadata):
    dtensor = _dtensor_class()
    if dtensor is None:
        return state_dict
    for key, value in state_dict.items():
        if isinstance(value, dtensor):
            state_dict[key] = value.full_tensor()
    return state_dict


def _local_shards(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    dtensor = _dtensor_class()
    if dtensor is None:
        return
    from torch.distributed.tensor import distribute_tensor

    targets = dict(module.named_parameters(prefix=prefix.rstrip(".")) if prefix else module.named_parameters())
    targets.update(module.named_buffers(prefix=prefix.rstrip(".")) if prefix else module.named_buffers())
    for key, value in list(state_dict.items()):
        target = targets.get(key)
        if isinstance(target, dtensor) and isinstance(value, torch.Tensor) and not isinstance(value, dtensor):
            if tuple(value.shape) != tuple(target.shape):
                continue  # let load_state_dict report the size mismatch
            state_dict[key] = distribute_tensor(
                value.to(target.device, target.dtype), target.device_mesh, target.placements, src_data_rank=None
            )

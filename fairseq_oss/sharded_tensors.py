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
import torch

try:
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # torch without DTensor: nothing to do
    DTensor = None

_MARK = "_fairseq_oss_sharded_tensor_hooks"


def has_dtensor(module: torch.nn.Module) -> bool:
    return DTensor is not None and any(
        isinstance(t, DTensor) for t in list(module.parameters()) + list(module.buffers())
    )


def register_sharded_tensor_hooks(module: torch.nn.Module) -> None:
    """Register both hooks on ``module`` (once; later calls do nothing)."""
    if DTensor is None or getattr(module, _MARK, False):
        return
    module._register_state_dict_hook(_full_tensors)
    module._register_load_state_dict_pre_hook(_local_shards, with_module=True)
    setattr(module, _MARK, True)


def _full_tensors(module, state_dict, prefix, local_metadata):
    for key, value in state_dict.items():
        if isinstance(value, DTensor):
            state_dict[key] = value.full_tensor()
    return state_dict


def _local_shards(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    targets = dict(module.named_parameters(prefix=prefix.rstrip(".")) if prefix else module.named_parameters())
    targets.update(module.named_buffers(prefix=prefix.rstrip(".")) if prefix else module.named_buffers())
    for key, value in list(state_dict.items()):
        target = targets.get(key)
        if isinstance(target, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            if tuple(value.shape) != tuple(target.shape):
                continue  # let load_state_dict report the size mismatch
            state_dict[key] = distribute_tensor(
                value.to(target.device, target.dtype), target.device_mesh, target.placements, src_data_rank=None
            )

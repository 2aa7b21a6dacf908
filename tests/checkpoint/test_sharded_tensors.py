"""The plugin's state-dict hooks for DTensor parameters, on CPU with gloo."""
import pytest
import torch

from ranks import run_ranks


def make(world_size, shard):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Linear(12, 2))
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if shard:
        mesh = init_device_mesh("cpu", (world_size,))
        model[0].weight = torch.nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh, [Shard(0)]))
    return model, full


def save_job(rank, world_size):
    from fairseq_oss.checkpoint.sharded_tensors import register_sharded_tensor_hooks

    model, full = make(world_size, shard=True)
    register_sharded_tensor_hooks(model)
    sd = model.state_dict()
    return {k: (type(v).__name__, v) for k, v in sd.items()}, full


def load_job(rank, world_size, saved):
    from fairseq_oss.checkpoint.sharded_tensors import register_sharded_tensor_hooks

    model, _ = make(world_size, shard=True)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # so that the load must bring every value
    register_sharded_tensor_hooks(model)
    model.load_state_dict(saved)
    w = model[0].weight
    return type(w).__name__, w.to_local().clone(), w.full_tensor()


@pytest.mark.parametrize("save_ws, load_ws", [(2, 3), (3, 1), (1, 2)])
def test_dtensor_saved_full_and_resharded_on_load(save_ws, load_ws):
    """Saved on one mesh: full tensors in the state dict. Loaded on another: each rank
    holds its own rows of the full weight, as a DTensor."""
    results = run_ranks(save_ws, save_job)
    sd, full = results[0]
    assert all(kind == "Tensor" for kind, _ in sd.values())
    saved = {k: v for k, (_, v) in sd.items()}
    assert saved.keys() == full.keys() and all(torch.equal(saved[k], full[k]) for k in full)
    loaded = run_ranks(load_ws, load_job, saved)
    rows = torch.tensor_split(full["0.weight"], load_ws)
    for rank, (kind, local, whole) in enumerate(loaded):
        assert kind == "DTensor"
        assert torch.equal(local, rows[rank]) and torch.equal(whole, full["0.weight"])


def test_hooks_change_nothing_without_dtensors():
    from fairseq_oss.checkpoint.sharded_tensors import register_sharded_tensor_hooks

    model, full = make(1, shard=False)
    before = model.state_dict()
    register_sharded_tensor_hooks(model)
    after = model.state_dict()
    assert list(before) == list(after) and all(before[k] is after[k] or torch.equal(before[k], after[k]) for k in before)
    other, _ = make(1, shard=False)
    for p in other.parameters():
        p.data.add_(1)
    register_sharded_tensor_hooks(other)
    other.load_state_dict(after)
    assert all(torch.equal(other.state_dict()[k], full[k]) for k in full)

"""Exact comparisons of optimizer state dicts and fairseq checkpoints."""
import torch


def assert_same_state_dict(got, want):
    """Same keys, same param_groups, and per entry the same step, dtype, shape and bits."""
    assert got["param_groups"] == want["param_groups"]
    assert list(got["state"]) == list(want["state"])
    for k, entry in want["state"].items():
        assert set(got["state"][k]) == set(entry), k
        assert got["state"][k]["step"] == entry["step"] and type(got["state"][k]["step"]) is int
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = got["state"][k][key], entry[key]
            assert a.dtype == b.dtype and a.shape == b.shape, (k, key)
            assert torch.equal(a, b), (k, key)


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_same_training_state(got_path, want_path):
    """Two fairseq checkpoints hold the same model bits, the same optimizer state (plain
    Adam format), update count, LR-scheduler state and data position."""
    got, want = load(got_path), load(want_path)
    assert got["model"].keys() == want["model"].keys()
    for name, t in want["model"].items():
        assert torch.equal(got["model"][name], t), name
    assert_same_state_dict(got["last_optimizer_state"], want["last_optimizer_state"])
    g, w = got["optimizer_history"][-1], want["optimizer_history"][-1]
    assert g["num_updates"] == w["num_updates"]
    assert g["lr_scheduler_state"] == w["lr_scheduler_state"]
    assert got["extra_state"]["train_iterator"] == want["extra_state"]["train_iterator"]


def _largest(tensors):
    return max((t.double().abs().max().item() for t in tensors if t.is_floating_point() and t.numel()), default=0.0)


def _assert_close(a, b, rtol, scale, what):
    """Same dtype and shape; every element within ``rtol * scale``."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if not a.is_floating_point():
        assert torch.equal(a, b), what
        return
    diff = (a.double() - b.double()).abs().max().item() if b.numel() else 0.0
    assert diff <= rtol * scale, f"{what}: differs by {diff:.3g}, {diff / max(scale, 1e-300):.3g} of the largest value"


def assert_close_training_state(got_path, want_path, rtol):
    """Two fairseq checkpoints of the same training, but for rounding in the order the
    gradients were summed: the same structure, update count, steps and data position;
    model weights, ``exp_avg`` and ``exp_avg_sq`` within ``rtol`` of the largest value of
    their kind in the checkpoint (not of each tensor's own: a tensor whose gradient is
    rounding noise, like an attention key's bias, differs in every bit)."""
    got, want = load(got_path), load(want_path)
    assert got["model"].keys() == want["model"].keys()
    scale = _largest(want["model"].values())
    for name, t in want["model"].items():
        _assert_close(got["model"][name], t, rtol, scale, name)
    g, w = got["last_optimizer_state"], want["last_optimizer_state"]
    assert g["param_groups"] == w["param_groups"] and list(g["state"]) == list(w["state"])
    for key in ("exp_avg", "exp_avg_sq"):
        scale = _largest(entry[key] for entry in w["state"].values())
        for k, entry in w["state"].items():
            assert g["state"][k]["step"] == entry["step"], k
            _assert_close(g["state"][k][key], entry[key], rtol, scale, (k, key))
    gh, wh = got["optimizer_history"][-1], want["optimizer_history"][-1]
    assert gh["num_updates"] == wh["num_updates"]
    assert got["extra_state"]["train_iterator"] == want["extra_state"]["train_iterator"]

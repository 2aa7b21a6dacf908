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

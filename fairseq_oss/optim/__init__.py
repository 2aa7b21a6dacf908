"""The optimizer: the partition, the collectives, the sharded Adam step and its
``torch.optim`` state API.

Owns which rank holds which elements of the Adam state (:mod:`.partition`, pure; what a
usable bucket size is, :mod:`.bucket_size`), the collectives that move them
(:mod:`.collectives`), the step and the state dict (:mod:`.sharded_adam`), and the
in-memory gather of the state on one rank (:mod:`.gather`). No file I/O and no fairseq:
checkpoints are :mod:`fairseq_oss.checkpoint`'s, the fairseq plugin is
:mod:`fairseq_oss.integration`'s. Public: :class:`ShardedAdam`.
"""
import importlib

__all__ = ["ShardedAdam"]


def __getattr__(name):
    if name == "ShardedAdam":
        return importlib.import_module(f"{__name__}.sharded_adam").ShardedAdam
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

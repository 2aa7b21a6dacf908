"""The fairseq optimizer ``oss_adam``: a drop-in for ``--optimizer adam``.

Owns the registration with fairseq and the translation of fairseq's config into a
:class:`~fairseq_oss.sharded_adam.ShardedAdam`. Its config *is* ``FairseqAdamConfig`` plus
the knobs below, so every flag of ``--optimizer adam`` works unchanged, with the same
defaults, and switching is changing one word.
"""
import logging
import math
from dataclasses import dataclass, field

import torch
from fairseq import optim
from fairseq.distributed import utils as distributed_utils
from fairseq.optim import FairseqOptimizer, register_optimizer
from fairseq.optim.adam import FairseqAdam, FairseqAdamConfig

from fairseq_oss import collectives
from fairseq_oss.sharded_adam import DEFAULT_BUCKET_BYTES, ShardedAdam

logger = logging.getLogger(__name__)

@dataclass
class FairseqOSSAdamConfig(FairseqAdamConfig):
    oss_bucket_mb: float = field(
        default=DEFAULT_BUCKET_BYTES / 2**20,
        metadata={
            "help": "size in MiB of one bucket of parameters or optimizer state moved by one "
            "collective (step all-gather, checkpoint consolidation); bounds the extra memory "
            "they need"
        },
    )
    oss_skip_checksums: bool = field(
        default=False,
        metadata={"help": "do not verify the checksums of a fairseq-oss checkpoint when loading it"},
    )
    oss_no_shared_fs: bool = field(
        default=False,
        metadata={
            "help": "ranks do not share a file system: rank 0 reads the checkpoint and sends each "
            "rank its slice of the optimizer state, one bucket at a time"
        },
    )


@register_optimizer("oss_adam", dataclass=FairseqOSSAdamConfig)
class FairseqOSSAdam(FairseqOptimizer):
    """fairseq's Adam with its state sharded across the data-parallel ranks (ZeRO-1).

    Checkpoints hold the state un-sharded, in the format ``--optimizer adam`` writes;
    the trainer's ``consolidate_optimizer()`` gathers it before a save.
    """

    def __init__(self, cfg: FairseqOSSAdamConfig, params):
        super().__init__(cfg)
        if getattr(cfg, "fp16_adam_stats", False):
            raise NotImplementedError("--fp16-adam-stats is not supported by oss_adam")
        if getattr(cfg, "tpu", False):
            raise NotImplementedError("oss_adam does not support TPUs")
        bucket_bytes = int(cfg.oss_bucket_mb * 2**20) if math.isfinite(cfg.oss_bucket_mb) else 0
        if bucket_bytes < 1:
            raise ValueError(
                f"--oss-bucket-mb must be a finite size of at least one byte "
                f"({1 / 2**20:.1e} MiB), got {cfg.oss_bucket_mb}"
            )
        group = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            group = distributed_utils.get_data_parallel_group()
        self._optimizer = ShardedAdam(
            params,
            **self.optimizer_config,
            process_group=group,
            bucket_bytes=bucket_bytes,
        )
        device = next(iter(self._optimizer._params), torch.empty(0)).device
        per_rank = collectives.all_gather_ints(self._optimizer.state_bytes(), group, device)
        logger.info(
            "oss_adam: Adam state sharded over %d rank(s) in %d bucket(s): %s MiB per rank "
            "(plain adam: %.2f MiB on every rank)",
            len(per_rank),
            len(self._optimizer.partition.buckets),
            ", ".join(f"{b / 2**20:.2f}" for b in per_rank),
            sum(per_rank) / 2**20,
        )

    # Same hyperparameters, parsed the same way, as --optimizer adam.
    optimizer_config = FairseqAdam.optimizer_config

    def average_params(self):
        raise NotImplementedError("oss_adam does not support BMUF")


# fairseq records the optimizer's class name in checkpoints and refuses to resume one
# whose name differs. An oss_adam checkpoint holds FairseqAdam's state in FairseqAdam's
# format, so it says so: stock adam resumes it, and it resumes stock adam's.
FairseqOSSAdam.__name__ = FairseqOSSAdam.__qualname__ = "FairseqAdam"


def _refusing_zero_sharding(fairseq_shard):
    """fairseq's ``optim.shard_`` (``--zero-sharding os``: fairscale's OSS around the
    optimizer), refusing oss_adam: fairscale would build one oss_adam per rank over
    different parameters, and their collectives would not match (gloo aborts, NCCL
    hangs). Called by the trainer as it builds the optimizer, on every rank alike."""

    def shard_(optimizer, group):
        if isinstance(getattr(optimizer, "optimizer", None), ShardedAdam):
            raise ValueError(
                "--optimizer oss_adam already shards Adam's state across the data-parallel "
                "ranks; --zero-sharding os would shard it a second time. Remove "
                "--zero-sharding os (or use --optimizer adam with --zero-sharding os)."
            )
        return fairseq_shard(optimizer, group)

    shard_.refuses_oss_adam = True
    return shard_


if not getattr(optim.shard_, "refuses_oss_adam", False):
    optim.shard_ = _refusing_zero_sharding(optim.shard_)

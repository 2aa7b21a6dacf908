"""fairseq's launcher (``distributed_utils.call_main``) for ``oss_adam``.

Owns what happens before any rank is spawned: refusing a configuration that oss_adam
cannot run (in one line, before a model is built or data read), dropping the ``oss_*``
settings when another optimizer is named, and taking over
``--write-checkpoints-asynchronously``, so that every rank's saves go to the background
(:mod:`.save_path`) and training ends only once the last one is complete.
"""
import functools
import os
import sys

from fairseq.distributed import utils as distributed_utils
from omegaconf import OmegaConf

from fairseq_oss.checkpoint import async_save
from fairseq_oss.checkpoint.format import CheckpointError
from fairseq_oss.integration import compat  # noqa: F401 - its launch fixes first: call_main is wrapped over them
from fairseq_oss.integration import optimizer, save_path
from fairseq_oss.integration import patching
from fairseq_oss.integration.patching import ORIGINAL


def call_main(cfg, main, **kwargs):
    """fairseq's launcher (fairseq-train, fairseq-hydra-train), with oss_adam taking over
    ``--write-checkpoints-asynchronously``: fairseq's own mode needs iopath (without it,
    fairseq-train returns at once, having trained nothing), skips the copies and does not
    wait for the last save. Each rank runs :func:`train_with_async_saves`. A configuration
    that oss_adam refuses (:func:`fairseq_oss.integration.optimizer.refusal`) exits here, in one line."""
    optimizer.drop_settings_of_oss_adam(cfg)
    problem = optimizer.refusal(cfg)
    if problem is not None:  # before any rank is spawned, model built or data read
        sys.exit(f"{os.path.basename(sys.argv[0]) or 'fairseq'}: error: {problem}")
    ckpt = cfg.checkpoint
    if OmegaConf.select(cfg, "optimizer._name") == "oss_adam" and ckpt.write_checkpoints_asynchronously:
        ckpt.write_checkpoints_asynchronously = False
        main = functools.partial(train_with_async_saves, main)
    return ORIGINAL["call_main"](cfg, main, **kwargs)


def train_with_async_saves(main, cfg, **kwargs):
    """``main(cfg)`` with every save written in the background, then waits for the last
    one: training ends only once it is complete, and fails if it failed."""
    save_path.BACKGROUND["requested"] = True
    try:
        result = main(cfg, **kwargs)
    except BaseException:
        async_save.wait_locally()
        raise
    finally:
        save_path.BACKGROUND["requested"] = False
    error = async_save.wait_locally()
    if error is not None:
        raise CheckpointError(f"the last asynchronous checkpoint save failed: {type(error).__name__}: {error}")
    return result


PATCHES = [(distributed_utils, "call_main", call_main)]
patching.apply(PATCHES)

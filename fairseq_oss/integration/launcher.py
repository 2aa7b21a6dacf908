"""fairseq's launcher (``distributed_utils.call_main``) for ``oss_adam``.

Owns what happens before any rank is spawned: refusing a configuration that oss_adam
cannot run (in one line, before a model is built or data read), dropping the ``oss_*``
settings when another optimizer is named, and taking over
``--write-checkpoints-asynchronously``, so that every rank's saves go to the background
(:mod:`.save_path`) and training ends only once the last one is complete. And ``--help``
with ``--optimizer oss_adam``, which lists oss_adam's flags. For every optimizer, each rank's
``main`` is followed by the stop of fairseq's background batch threads (:mod:`.data_threads`).
"""
import contextlib
import functools
import io
import os
import sys

from fairseq import options
from fairseq.distributed import utils as distributed_utils
from omegaconf import OmegaConf

from fairseq_oss.checkpoint import async_save
from fairseq_oss.checkpoint.format import CheckpointError
from fairseq_oss.integration import compat  # noqa: F401 - its launch fixes first: call_main is wrapped over them
from fairseq_oss.integration import data_threads, optimizer, save_path
from fairseq_oss.integration import patching
from fairseq_oss.integration.patching import ORIGINAL


def call_main(cfg, main, **kwargs):
    """fairseq's launcher (fairseq-train, fairseq-hydra-train), with oss_adam taking over
    ``--write-checkpoints-asynchronously``: fairseq's own mode needs iopath (without it,
    fairseq-train returns at once, having trained nothing), skips the copies and does not
    wait for the last save. Each rank runs :func:`train_with_async_saves`. A configuration
    that oss_adam refuses (:func:`fairseq_oss.integration.optimizer.refusal`) exits here, in one line.
    And, whatever the optimizer, each rank stops fairseq's background batch threads once its
    ``main`` ends (:mod:`.data_threads`: left running, they can abort the process as it exits)."""
    optimizer.drop_settings_of_oss_adam(cfg)
    problem = optimizer.refusal(cfg)
    if problem is not None:  # before any rank is spawned, model built or data read
        sys.exit(f"{os.path.basename(sys.argv[0]) or 'fairseq'}: error: {problem}")
    ckpt = cfg.checkpoint
    if OmegaConf.select(cfg, "optimizer._name") == "oss_adam" and ckpt.write_checkpoints_asynchronously:
        ckpt.write_checkpoints_asynchronously = False
        main = functools.partial(train_with_async_saves, main)
    main = functools.partial(data_threads.stopping_background_loaders, main)  # any optimizer
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


_HELP = ("-h", "--help")


def _names_oss_adam(argv) -> bool:
    return any(
        (a == "--optimizer" and i + 1 < len(argv) and argv[i + 1] == "oss_adam") or a == "--optimizer=oss_adam"
        for i, a in enumerate(argv)
    )


def parse_args_and_arch(parser, input_args=None, parse_known=False, suppress_defaults=False, modify_parser=None):
    """fairseq's, but ``--help`` with ``--optimizer oss_adam`` lists the optimizer's flags
    (``--adam-betas``, ``--oss-grad-reduction``, ...) and those of the chosen task and
    model: fairseq's first parse prints the help and exits before it adds them. The
    arguments are parsed without ``--help`` first, quietly (where that fails, without a
    data directory or an ``--arch``, the help holds what was added before the failure, and
    oss_adam's flags), then the whole help is printed."""
    argv = list(sys.argv[1:] if input_args is None else input_args)
    if suppress_defaults or not any(a in _HELP for a in argv) or not _names_oss_adam(argv):
        return ORIGINAL["parse_args_and_arch"](parser, input_args, parse_known, suppress_defaults, modify_parser)
    rest = [a for a in argv if a not in _HELP]
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            ORIGINAL["parse_args_and_arch"](parser, rest, True, False, modify_parser)
        except (SystemExit, Exception):
            pass
    if "--oss-grad-reduction" not in parser._option_string_actions:  # the parse stopped before the optimizer
        from fairseq.dataclass.utils import gen_parser_from_dataclass

        gen_parser_from_dataclass(parser, optimizer.FairseqOSSAdamConfig())
    parser.print_help()
    sys.exit(0)


PATCHES = [(distributed_utils, "call_main", call_main), (options, "parse_args_and_arch", parse_args_and_arch)]
patching.apply(PATCHES)

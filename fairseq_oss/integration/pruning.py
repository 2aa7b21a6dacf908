"""fairseq's ``--keep-*`` rules, applied after an asynchronous save has committed.

Owns one thing: removing the old checkpoints that fairseq's ``--keep-interval-updates``
(with ``--keep-interval-updates-pattern``), ``--keep-last-epochs`` and
``--keep-best-checkpoints`` say to remove. fairseq applies them inline at the end of
``checkpoint_utils.save_checkpoint`` (fairseq 0.12, ``checkpoint_utils.py:150-203``),
right after the save. An asynchronous save has then only handed its checkpoint over:
its file has no final name yet, so fairseq would count one file too few and keep one
too many, and a save that later fails would already have cost an old checkpoint. So
for asynchronous saves :mod:`fairseq_oss.integration.save_path` turns fairseq's pruning off and
the background job calls :func:`prune` once the new file and its copies are in place.

The rules are fairseq's, line for line: same patterns, same order, same "keep the first
N of the descending list". Touches only names that match those patterns in the save
directory; never opens a file. No collectives (rank 0 only, as in fairseq).
"""
import logging
import os
from dataclasses import dataclass

from fairseq import checkpoint_utils

logger = logging.getLogger(__name__)

KEEP_FLAGS = ("keep_interval_updates", "keep_last_epochs", "keep_best_checkpoints")


@dataclass(frozen=True)
class KeepRules:
    """What fairseq's checkpoint config says to keep, as of one save."""

    save_dir: str
    suffix: str
    end_of_epoch: bool
    keep_interval_updates: int
    keep_interval_updates_pattern: int
    keep_last_epochs: int
    keep_best_checkpoints: int
    best_checkpoint_metric: str
    maximize_best_checkpoint_metric: bool

    @classmethod
    def of(cls, cfg, suffix: str, end_of_epoch: bool) -> "KeepRules":
        return cls(cfg.save_dir, suffix, end_of_epoch, cfg.keep_interval_updates, cfg.keep_interval_updates_pattern,
                   cfg.keep_last_epochs, cfg.keep_best_checkpoints, cfg.best_checkpoint_metric,
                   cfg.maximize_best_checkpoint_metric)

    @property
    def prunes(self) -> bool:
        return self.keep_interval_updates > 0 or self.keep_last_epochs > 0 or self.keep_best_checkpoints > 0


def doomed(rules: KeepRules):
    """The paths fairseq's rules remove from ``rules.save_dir`` as it is now."""
    paths = checkpoint_utils.checkpoint_paths
    out = []
    if not rules.end_of_epoch and rules.keep_interval_updates > 0:
        pattern = r"checkpoint_\d+_(\d+){}\.pt".format(rules.suffix)
        if rules.keep_interval_updates_pattern == -1:
            found = paths(rules.save_dir, pattern=pattern)
        else:
            found = [p for p, n in paths(rules.save_dir, pattern=pattern, keep_match=True)
                     if n % rules.keep_interval_updates_pattern != 0]
        out += found[rules.keep_interval_updates:]
    if rules.keep_last_epochs > 0:
        out += paths(rules.save_dir, pattern=r"checkpoint(\d+){}\.pt".format(rules.suffix))[rules.keep_last_epochs:]
    if rules.keep_best_checkpoints > 0:
        found = paths(rules.save_dir, pattern=r"checkpoint\.best_{}_(\d+\.?\d*){}\.pt".format(
            rules.best_checkpoint_metric, rules.suffix))
        if not rules.maximize_best_checkpoint_metric:
            found = found[::-1]
        out += found[rules.keep_best_checkpoints:]
    return out


def prune(rules: KeepRules) -> None:
    """Remove what :func:`doomed` names (a name that is already gone is skipped)."""
    for path in doomed(rules):
        if os.path.lexists(path):
            os.remove(path)
            logger.info("removed old checkpoint %s (--keep-* rules, after the asynchronous save committed)", path)

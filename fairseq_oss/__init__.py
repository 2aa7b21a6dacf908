"""fairseq-oss: Adam with its state sharded across data-parallel ranks, for fairseq.

The package, as its folders:

* :mod:`fairseq_oss.optim`: the optimizer (the partition, the collectives, the sharded
  Adam step and its ``torch.optim`` state API); no file I/O, no fairseq;
* :mod:`fairseq_oss.checkpoint`: the checkpoint file (format and index, parallel,
  streamed and background writes, sliced loads, file safety); takes an optimizer and
  moves its shards; no fairseq;
* :mod:`fairseq_oss.integration`: the fairseq plugin (``--optimizer oss_adam``, its save
  and load path, its launcher), the only code that imports fairseq;
* :mod:`fairseq_oss.tools`: the ``fairseq-oss`` command.

Imports point down that list (integration, tools -> checkpoint -> optim), never up.

Public API, stable across releases (everything else is private and may move):

* ``fairseq_oss.ShardedAdam`` (:class:`fairseq_oss.optim.ShardedAdam`): the
  ``torch.optim.Optimizer``, usable without fairseq;
* ``fairseq_oss.save_optimizer_state`` / ``fairseq_oss.load_optimizer_state``: its state
  into a checkpoint that a ``CheckpointWriter`` writes, and back, at any world size;
* ``fairseq_oss.CheckpointWriter``, ``CheckpointReader``, ``CheckpointIndex``,
  ``CheckpointError`` (:mod:`fairseq_oss.checkpoint`): write, read and index checkpoints;
* ``fairseq_oss.tools.main``: the ``fairseq-oss`` command as a function (``argv`` list
  in, exit code out);
* ``--optimizer oss_adam`` and its flags, and ``configs/``.

Importing this package must stay cheap: the ``fairseq_oss.pth`` file installed next to it
runs ``import fairseq_oss`` in every Python process of the environment. So this module
imports neither torch nor fairseq (the public names above are imported on first use). It
registers the plugin in one of two ways:

* fairseq is already imported (``--user-dir``, or ``import fairseq_oss`` after fairseq):
  register now;
* otherwise: put a finder on ``sys.meta_path`` that registers right after the ``fairseq``
  package has executed (its ``__init__`` imports all of fairseq's registries; every
  fairseq entry point imports it before parsing arguments or composing a Hydra config).
"""
import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.3.0"

_TRIGGER = "fairseq"
_PUBLIC = {
    "ShardedAdam": "fairseq_oss.optim.sharded_adam",
    "save_optimizer_state": "fairseq_oss.checkpoint.optimizer_state",
    "load_optimizer_state": "fairseq_oss.checkpoint.optimizer_state",
    "CheckpointWriter": "fairseq_oss.checkpoint.format",
    "CheckpointReader": "fairseq_oss.checkpoint.format",
    "CheckpointError": "fairseq_oss.checkpoint.format",
    "CheckpointIndex": "fairseq_oss.checkpoint.index",
}


def __getattr__(name):  # the public API, imported on first use (this module stays cheap)
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register():
    """Register ``oss_adam`` with fairseq and install the plugin's patches
    (:mod:`fairseq_oss.integration`). Idempotent."""
    import fairseq_oss.integration  # noqa: F401


class _RegisterAfterFairseq(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of ``fairseq`` so that
    :func:`register` runs as soon as that module has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TRIGGER:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from recursing
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            register()

        spec.loader.exec_module = exec_then_register
        return spec


def _install():
    if _TRIGGER in sys.modules:
        register()
    elif not any(isinstance(f, _RegisterAfterFairseq) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterFairseq())


_install()

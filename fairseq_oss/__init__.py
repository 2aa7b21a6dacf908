"""fairseq-oss: Adam with its state sharded across data-parallel ranks, for fairseq.

Importing this package must stay cheap: the ``fairseq_oss.pth`` file installed next to it
runs ``import fairseq_oss`` in every Python process of the environment. So this module
imports neither torch nor fairseq. It registers the plugin (``--optimizer oss_adam`` and
the CPU launch fixes in :mod:`fairseq_oss.compat`) in one of two ways:

* fairseq is already imported (``--user-dir``, or ``import fairseq_oss`` after fairseq):
  register now;
* otherwise: put a finder on ``sys.meta_path`` that registers right after the ``fairseq``
  package has executed (its ``__init__`` imports all of fairseq's registries; every
  fairseq entry point imports it before parsing arguments or composing a Hydra config).
"""
import importlib.abc
import importlib.util
import sys

__version__ = "0.3.0"

_TRIGGER = "fairseq"


def register():
    """Register ``oss_adam`` with fairseq and apply the compatibility fixes and the
    checkpoint path. Idempotent.

    Each is done by importing its module, so that it also happens when one of them is
    what imported fairseq (the hook then fires while that module is half-imported, and
    the module finishes the job itself)."""
    import fairseq_oss.checkpointing  # noqa: F401
    import fairseq_oss.compat  # noqa: F401
    import fairseq_oss.optimizer  # noqa: F401


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

"""Where a model waits for the parameters that a deferred step is still handing over.

With ``ShardedAdam(defer_exchange=True)`` the step returns while the other ranks' updated
shards are still arriving (:mod:`fairseq_oss.optim.param_exchange`). No read of a
parameter may come before its pieces have: this module puts the waits where the reads are.

* **The training forward** runs under :class:`WaitForParams`, a ``TorchFunctionMode``: every
  torch function called with a parameter (or a view of one) among its arguments first waits
  for that parameter alone, so the first layer computes while the last ones are still on
  their way. It sees the parameters where they are used, not where they are owned: a module
  that hands a child's weight to a functional call without calling the child (fairseq's
  ``MultiheadAttention`` passes ``q_proj.weight`` to ``F.multi_head_attention_forward``)
  waits too, where a forward pre-hook on each module, as Megatron's distributed optimizer
  uses, would let it read a stale weight. Each module's forward pre-hook also waits for
  the module's own parameters, for a forward that hands them to code the mode does not
  see (a C++ extension reached without a torch function call on them).
* **Everything else waits for all of it** (:func:`install_read_hooks`): a forward of any
  module outside that mode (a generator calling ``model.encoder``), ``state_dict()`` (saves,
  EMA), ``load_state_dict()`` of any module of the model; and the next step.
* **Any other read, on the thread that stepped** (:func:`watch`): from the deferred step's
  return until everything has arrived, the same mode sits on that thread's mode stack, so
  that code outside the model's modules reading a parameter (``p.data``, ``p.tolist()``,
  ``p.detach().numpy()``, ``p[0]``, ``torch.equal(p, q)``) waits for that parameter too.
  Reads of a parameter's metadata (``.grad``, ``.shape``, ``requires_grad`` ...) do not
  wait: fairseq's ``zero_grad`` sets every ``.grad`` right after the step. The training
  forward runs under it, and takes it off the stack (:func:`settle`) once everything has
  arrived, so what follows pays nothing for it. (A step taken inside a mode of someone
  else's waits for everything before it returns instead.) Another thread's reads are not
  seen: the mode stack is per thread.
* **A copy or a pickle** of a parameter (so of any module holding one: fairseq builds its EMA
  as ``copy.deepcopy(model)`` right after a step; ``torch.save(model)``, ``copy.copy``)
  waits for that parameter: the first :class:`ReadGuard` wraps
  ``torch.nn.Parameter.__deepcopy__`` and ``__reduce_ex__`` for the whole process.

Nothing here is collective: a rank waits for its own messages.
"""
from typing import Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

from fairseq_oss.optim import param_exchange
from fairseq_oss.optim.param_exchange import ParamExchange


# What reads a tensor's metadata, not its values (attributes, and methods): a parameter
# handed to these is not waited for.
_METADATA = frozenset({
    "grad", "_grad", "requires_grad", "requires_grad_", "retain_grad", "retains_grad", "is_leaf", "grad_fn",
    "_grad_fn", "_base", "_version", "output_nr", "_backward_hooks", "_post_accumulate_grad_hooks",
    "register_hook", "register_post_accumulate_grad_hook", "names",
    "shape", "size", "dim", "ndim", "ndimension", "numel", "nelement", "__len__", "dtype", "element_size",
    "itemsize", "nbytes", "stride", "storage_offset", "is_contiguous", "layout", "device", "get_device",
    "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_floating_point", "is_complex", "__hash__",
})


def _reads_values(func) -> bool:
    """Whether the torch function ``func`` may read (or write) its tensors' values: not a
    read of metadata (a method in :data:`_METADATA`, or such an attribute's getter or
    setter)."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    return name not in _METADATA


class WaitForParams(TorchFunctionMode):
    """Within the block (or while :func:`watch` keeps it on the stack), a torch function
    that may read its tensors' values waits for the parameters among its arguments
    (tensors, or tensors in lists and tuples) that ``exchange`` has not received yet.
    Once everything has arrived it only passes calls through."""

    def __init__(self, exchange: ParamExchange, watching: bool = False):
        super().__init__()
        self.exchange = exchange
        self.watching = watching  # pushed by watch(), taken off by settle()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.exchange.unread and _reads_values(func):
            self._wait_for(args)
            self._wait_for(kwargs.values())
        return func(*args, **kwargs)

    def _wait_for(self, values) -> None:
        for v in values:
            if isinstance(v, torch.Tensor):
                self.exchange.wait_tensor(v)
            elif isinstance(v, (list, tuple)):
                self._wait_for(v)


class ReadGuard:
    """The waits for one model: :meth:`forward` runs a forward under :class:`WaitForParams`,
    and the hooks that :func:`install_read_hooks` installs call :meth:`wait_all` unless
    such a forward is running. ``exchange()`` returns the exchange of the optimizer built
    last over the model's parameters (None: nothing to wait for). Building one makes copies
    and pickles of parameters wait, process-wide."""

    def __init__(self, exchange: Callable[[], Optional[ParamExchange]]):
        self.exchange = exchange
        self.in_forward = False
        _wait_in_copies()

    def forward(self, module, *args, **kwargs):
        exchange = self.exchange()
        if not self.in_forward:
            settle()  # a watch whose parameters were all read meanwhile
        if exchange is None or not exchange.unread or self.in_forward:
            return module(*args, **kwargs)
        self.in_forward = True
        try:
            if _watch_of(exchange) is not None:  # the step's watch is the mode
                return module(*args, **kwargs)
            with WaitForParams(exchange):
                return module(*args, **kwargs)
        finally:
            self.in_forward = False
            settle()

    def before_forward(self, module, _args) -> None:
        """A module's forward pre-hook. Inside :meth:`forward`: wait for the module's own
        parameters, which its forward may hand to code that the mode does not see (a
        C++ extension called without a torch function touching them first); outside:
        wait for all."""
        if not self.in_forward:
            self.wait_all()
            return
        exchange = self.exchange()
        if exchange is not None and exchange.unread:
            for p in module.parameters(recurse=False):
                exchange.wait_tensor(p)
        settle()  # once everything has arrived, the rest of the forward runs without the watch

    def wait_all(self, *_args, **_kwargs) -> None:
        if self.in_forward:
            return
        exchange = self.exchange()
        if exchange is not None and exchange.in_flight:
            exchange.wait_all()
        settle()


def watch(exchange: ParamExchange) -> None:
    """Make any torch function called on this thread with a parameter of ``exchange`` (or a
    view of one) wait for that parameter first, until :func:`settle` (a
    :class:`WaitForParams` pushed on this thread's mode stack; nothing if nothing is in
    flight or it is there already). ShardedAdam's deferred step calls it as it returns.

    Where a mode of someone else's is active (a ``with`` block around the step), whose
    exit would take off whatever is on top of the stack, this waits for everything
    instead: the step is then not deferred. ``torch.device`` modes (``set_default_device``)
    take their exit with others above them, and do not stop it."""
    if not exchange.unread or _watch_of(exchange) is not None:
        return
    if all(_leaves_watch_on(m) for m in torch.overrides._get_current_function_mode_stack()):
        WaitForParams(exchange, watching=True).__enter__()
    else:
        exchange.wait_all()


def settle() -> None:
    """Take off this thread's mode stack the :func:`watch` modes on top of it whose exchanges
    have arrived (one below a mode pushed after it and still active stays: it then only
    passes calls through, until a later settle finds it on top)."""
    while True:
        top = torch.overrides._get_current_function_mode()
        if not (isinstance(top, WaitForParams) and top.watching and not top.exchange.unread):
            return
        top.__exit__(None, None, None)


def _leaves_watch_on(mode) -> bool:
    """Whether ``mode``'s exit leaves a mode pushed above it on the stack."""
    from torch.utils._device import DeviceContext  # not at import: fairseq never loads it

    return isinstance(mode, DeviceContext) or (isinstance(mode, WaitForParams) and mode.watching)


def _watch_of(exchange: ParamExchange) -> Optional[WaitForParams]:
    for mode in torch.overrides._get_current_function_mode_stack():
        if isinstance(mode, WaitForParams) and mode.watching and mode.exchange is exchange:
            return mode
    return None


def install_read_hooks(model: torch.nn.Module, guard: ReadGuard) -> list:
    """Make every module of ``model`` wait before its forward (for its own parameters
    inside :meth:`ReadGuard.forward`, else for all the parameters in flight), its
    ``state_dict()`` and its ``load_state_dict()`` (for all). Returns the hooks' handles."""
    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(guard.before_forward))
        handles.append(m.register_state_dict_pre_hook(guard.wait_all))
        handles.append(m.register_load_state_dict_pre_hook(guard.wait_all))
    return handles


def _deepcopy_when_arrived(self, memo):
    """``torch.nn.Parameter.__deepcopy__``, once this parameter holds what the last step
    computed."""
    if id(self) not in memo:
        param_exchange.wait_for(self)
    return PARAMETER_DEEPCOPY(self, memo)


def _reduce_ex_when_arrived(self, protocol):
    """``torch.nn.Parameter.__reduce_ex__`` (pickling: ``torch.save``, ``copy.copy``), once
    this parameter holds what the last step computed: ``torch.save`` writes the storage's
    bytes after pickling the object that holds it, so waiting here is waiting before."""
    param_exchange.wait_for(self)
    return PARAMETER_REDUCE_EX(self, protocol)


PARAMETER_DEEPCOPY = torch.nn.Parameter.__deepcopy__
PARAMETER_REDUCE_EX = torch.nn.Parameter.__reduce_ex__


def _wait_in_copies() -> None:
    """Wrap ``torch.nn.Parameter.__deepcopy__`` and ``__reduce_ex__`` (once, for the whole
    process)."""
    if torch.nn.Parameter.__deepcopy__ is PARAMETER_DEEPCOPY:
        torch.nn.Parameter.__deepcopy__ = _deepcopy_when_arrived
    if torch.nn.Parameter.__reduce_ex__ is PARAMETER_REDUCE_EX:
        torch.nn.Parameter.__reduce_ex__ = _reduce_ex_when_arrived

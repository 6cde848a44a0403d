"""A host-sync counter: every read of a tensor's values by the host, by op and by code region.

On an accelerator each of these blocks the host until the device has caught up, so the host
can no longer run ahead of the device. The counter sees them on CPU runs too, where nothing
blocks, by what the code asks for rather than by what it costs there:

- a ``TorchDispatchMode`` counting the ops whose result the host must read:
  ``aten._local_scalar_dense`` (``.item()``, ``int()``, ``float()``, ``bool()`` of a tensor),
  ``aten.equal``, ``aten.is_nonzero``, the ops whose output shape depends on the values
  (``aten.nonzero``, ``aten.masked_select``, the ``unique`` family, indexing with a bool
  mask) and copies to the CPU from another device (``aten._to_copy``, ``aten.copy_``);
- patched ``Tensor.tolist``, ``Tensor.numpy``, ``Tensor.item``, ``Tensor.cpu`` and
  ``Tensor.to("cpu")``, which on CPU tensors read memory without dispatching (or do
  nothing), but copy from the device on an accelerator. ``to`` counts only a device named
  by string: ``x.to(query.device)`` is the host-to-device move of a host-made tensor, which
  a CPU run cannot tell from a read by its target. An op a patched method runs inside
  is not counted again (one ``.item()`` counts once).

``with count_host_syncs() as syncs:`` counts everywhere inside; ``everywhere=False`` counts
only inside ``syncs.region(name)`` blocks (and runs the dispatch mode only there, which keeps
a whole training loop at its speed). Every count is filed under the innermost open region
(None outside any), so ``syncs.by_op(region="laga.forward")`` separates what one piece of
code caused from the rest.
"""
from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Dict, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ANY = object()  # by_op/total: every region
_aten = torch.ops.aten
# Packets (every overload) whose result the host reads, always.
_READS = {_aten._local_scalar_dense: "aten._local_scalar_dense", _aten.equal: "aten.equal",
          _aten.is_nonzero: "aten.is_nonzero", _aten.nonzero: "aten.nonzero",
          _aten.masked_select: "aten.masked_select"}
for _name in ("unique", "_unique", "_unique2", "unique_dim", "unique_consecutive"):
    if hasattr(_aten, _name):
        _READS[getattr(_aten, _name)] = f"aten.{_name}"
_PATCHED = ("tolist", "numpy", "item", "cpu", "to")


def _is_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _copy_to_cpu(func, args, kwargs) -> bool:
    """A copy whose destination is the CPU and whose source is not."""
    packet = func.overloadpacket
    if packet is _aten._to_copy:
        source, device = args[0], kwargs.get("device")
        return _is_cpu(device) and source.device.type != "cpu"
    if packet is _aten.copy_:
        dest, source = args[0], args[1]
        return (isinstance(source, torch.Tensor) and dest.device.type == "cpu"
                and source.device.type != "cpu")
    return False


def _bool_index(func, args) -> bool:
    """``t[mask]``: indexing with a bool (or uint8) mask runs ``nonzero`` inside the kernel."""
    if func.overloadpacket is not _aten.index:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (args[1] if len(args) > 1 else ()))


def _to_cpu_target(args, kwargs) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` names the CPU, by name ("cpu", "cpu:0").

    Only a device given by name counts: ``x.to(query.device)`` or ``x.to(other)`` moves a
    host-made tensor (positions, an index) to where the inputs live, a copy to the device
    on an accelerator, and on a CPU run its target reads as the CPU too."""
    device = kwargs.get("device")
    for a in args:
        if isinstance(a, str):
            device = a
    if not isinstance(device, str):
        return False
    try:
        return _is_cpu(device)
    except RuntimeError:  # a string that is no device
        return False


class HostSyncs:
    """Counts by (region, op); open it with :func:`count_host_syncs`."""

    def __init__(self, everywhere: bool):
        self.everywhere = everywhere
        self.counts: Counter = Counter()
        self._local = threading.local()

    # ------------------------------------------------------------------ reading
    def by_op(self, region=ANY) -> Dict[str, int]:
        """{op: count} of ``region`` (a name, None: outside any region, ANY: all)."""
        out: Counter = Counter()
        for (where, op), n in self.counts.items():
            if region is ANY or where == region:
                out[op] += n
        return dict(out)

    def total(self, region=ANY) -> int:
        return sum(self.by_op(region).values())

    def by_region(self) -> Dict[Optional[str], int]:
        out: Counter = Counter()
        for (where, _), n in self.counts.items():
            out[where] += n
        return dict(out)

    # ------------------------------------------------------------------ regions
    @contextlib.contextmanager
    def region(self, name: str):
        """File the counts made inside under ``name`` (the innermost region wins)."""
        stack = self._stack()
        stack.append(name)
        mode = _Mode(self) if not self.everywhere and len(stack) == 1 else None
        try:
            if mode is None:
                yield self
            else:
                with mode:
                    yield self
        finally:
            stack.pop()

    def _stack(self):
        if not hasattr(self._local, "stack"):
            self._local.stack = []
            self._local.inside_method = 0
        return self._local.stack

    def current(self) -> Optional[str]:
        """The innermost open region (None outside every region)."""
        stack = self._stack()
        return stack[-1] if stack else None

    def active(self) -> bool:
        return self.everywhere or bool(self._stack())

    def count(self, op: str) -> None:
        stack = self._stack()
        if self._local.inside_method or not (self.everywhere or stack) or _IN_STAND_IN.depth:
            return
        self.counts[(stack[-1] if stack else None, op)] += 1

    @contextlib.contextmanager
    def _method(self, op: str, counts: bool = True):
        """A patched method's call: counted once, its inner ops not again."""
        if counts:
            self.count(op)
        self._stack()
        self._local.inside_method += 1
        try:
            yield
        finally:
            self._local.inside_method -= 1


class _Mode(TorchDispatchMode):
    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _READS.get(func.overloadpacket)
        if name is None and _copy_to_cpu(func, args, kwargs):
            name = f"aten.{func.overloadpacket.__name__} to cpu"
        if name is None and _bool_index(func, args):
            name = "aten.index (bool mask)"
        if name is not None:
            self.syncs.count(name)
        return func(*args, **kwargs)


_OPEN = []            # the open counters, innermost last
_ORIGINAL: Dict[str, object] = {}


def _patched(method: str):
    original = _ORIGINAL[method]

    def call(self, *args, **kwargs):
        counters = [c for c in _OPEN if c.active()]
        if method == "to":
            counts = _to_cpu_target(args, kwargs)
            op = "Tensor.to(cpu)"
        else:
            counts, op = True, f"Tensor.{method}"
        with contextlib.ExitStack() as stack:
            for c in counters:
                stack.enter_context(c._method(op, counts))
            return original(self, *args, **kwargs)

    call.__name__ = method
    call.__doc__ = getattr(original, "__doc__", None)
    return call


def _install():
    for method in _PATCHED:
        _ORIGINAL[method] = getattr(torch.Tensor, method)
        setattr(torch.Tensor, method, _patched(method))


def _uninstall():
    for method, original in _ORIGINAL.items():
        setattr(torch.Tensor, method, original)
    _ORIGINAL.clear()


class _StandIn(threading.local):
    depth = 0


_IN_STAND_IN = _StandIn()


@contextlib.contextmanager
def stand_in_checks():
    """A CPU stand-in's own checks of an NPU op's arguments: not counted. The real op checks
    them on the device, without a host read; the stand-in reads them to refuse as strictly."""
    _IN_STAND_IN.depth += 1
    try:
        yield
    finally:
        _IN_STAND_IN.depth -= 1


@contextlib.contextmanager
def count_host_syncs(everywhere: bool = True):
    """``with count_host_syncs() as syncs:`` counts every host read inside (module docstring)."""
    syncs = HostSyncs(everywhere)
    if not _OPEN:
        _install()
    _OPEN.append(syncs)
    try:
        if everywhere:
            with _Mode(syncs):
                yield syncs
        else:
            yield syncs
    finally:
        _OPEN.remove(syncs)
        if not _OPEN:
            _uninstall()

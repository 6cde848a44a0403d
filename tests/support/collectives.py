"""A collective counter that sees every ``torch.distributed`` collective, small ones included.

``mindspeed_laga.comm.count_bytes`` counts what LAGA's own wrappers send and files the
ranks' handshake apart from the data; a collective issued around those wrappers would not
show there at all. This counter wraps the ``torch.distributed`` functions themselves for the
duration of a ``with`` block: the module attributes, and every alias a loaded module holds
of them (``comm._all_gather_tensor``, a ``from torch.distributed import ...``), so a call
by any route is recorded with its kind (the function's name), its payload in bytes and
the size of its group. Payload follows ``comm``'s convention: an all-gather's input, a
reduce-scatter's output, an all-to-all's input, the tensor(s) of an all-reduce, broadcast
or list all-gather; 0 for a barrier or an object collective.

Records are filed under the innermost open region of an optional
:class:`host_syncs.HostSyncs`-like ``regions`` object (anything with a ``current()``), or
under the counter's own :meth:`Collectives.region`.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# Each wrapped function and where its payload lies: ("arg", i) the i-th positional argument
# (or its keyword), "all" every tensor argument, None nothing.
PAYLOAD = {
    "all_gather_into_tensor": ("arg", 1, "input_tensor"),
    "all_gather_single": ("arg", 1, "input_tensor"),
    "_all_gather_base": ("arg", 1, "input_tensor"),
    "reduce_scatter_tensor": ("arg", 0, "output"),
    "reduce_scatter_single": ("arg", 0, "output"),
    "_reduce_scatter_base": ("arg", 0, "output"),
    "all_to_all_single": ("arg", 1, "input"),
    "all_to_all": ("arg", 1, "input_tensor_list"),
    "all_reduce": ("arg", 0, "tensor"),
    "all_reduce_coalesced": ("arg", 0, "tensors"),
    "broadcast": ("arg", 0, "tensor"),
    "reduce": ("arg", 0, "tensor"),
    "all_gather": ("arg", 1, "tensor"),
    "all_gather_coalesced": ("arg", 1, "input_tensor_list"),
    "gather": ("arg", 0, "tensor"),
    "scatter": ("arg", 0, "tensor"),
    "reduce_scatter": ("arg", 0, "output"),
    "send": ("arg", 0, "tensor"),
    "recv": ("arg", 0, "tensor"),
    "isend": ("arg", 0, "tensor"),
    "irecv": ("arg", 0, "tensor"),
    "batch_isend_irecv": None,
    "barrier": None,
    "monitored_barrier": None,
    "all_gather_object": None,
    "broadcast_object_list": None,
    "gather_object": None,
    "scatter_object_list": None,
}
# The kinds comm.count_bytes files as data, and the functions behind each.
DATA = {"all_gather": ("all_gather_into_tensor", "all_gather_single", "_all_gather_base"),
        "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter_single",
                           "_reduce_scatter_base"),
        "all_to_all": ("all_to_all_single",)}
KIND_OF = {name: kind for kind, names in DATA.items() for name in names}


@dataclass
class Call:
    name: str          # the torch.distributed function
    payload: int       # bytes, comm's convention (module docstring)
    group_size: int
    region: Optional[str]
    backward: bool     # issued while autograd runs a backward (recompute included)
    dtype: Optional[torch.dtype] = None

    @property
    def kind(self) -> str:
        """comm's kind for the data collectives, else the function's name."""
        return KIND_OF.get(self.name, self.name)


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _first_dtype(value):
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, (list, tuple)) and value:
        return _first_dtype(value[0])
    return None


def _in_backward() -> bool:
    current = getattr(torch._C, "_current_autograd_node", None)
    return current is not None and current() is not None


class Collectives:
    """Records of every collective; open it with :func:`count_collectives`."""

    def __init__(self, regions=None, everywhere: bool = True):
        self.calls: List[Call] = []
        self._regions = regions
        self.everywhere = everywhere
        self._local = threading.local()

    @contextlib.contextmanager
    def region(self, name: str):
        stack = self._stack()
        stack.append(name)
        try:
            yield self
        finally:
            stack.pop()

    def _stack(self):
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def current(self) -> Optional[str]:
        stack = self._stack()
        if stack:
            return stack[-1]
        return self._regions.current() if self._regions is not None else None

    def record(self, name: str, args, kwargs) -> None:
        region = self.current()
        if region is None and not self.everywhere:
            return
        spec = PAYLOAD[name]
        value = None
        if spec is not None:
            _, index, keyword = spec
            value = args[index] if len(args) > index else kwargs.get(keyword)
        group = kwargs.get("group")
        if group is None and name in ("barrier", "monitored_barrier", "all_gather_object",
                                      "broadcast_object_list"):
            group = args[0] if args and not isinstance(args[0], (list, torch.Tensor)) else None
        try:
            size = dist.get_world_size(group)
        except (RuntimeError, ValueError, TypeError):
            size = -1
        self.calls.append(Call(name, _nbytes(value), size, region, _in_backward(),
                               _first_dtype(value)))

    # ------------------------------------------------------------------ reading
    def select(self, region=..., backward: Optional[bool] = None) -> List[Call]:
        """The calls of ``region`` (...: any; None: outside every region) and phase."""
        return [c for c in self.calls if (region is ... or c.region == region)
                and (backward is None or c.backward == backward)]

    def kinds(self, region=..., backward: Optional[bool] = None) -> Dict[str, int]:
        """{kind: calls}: comm's kinds for the data collectives, else the function names."""
        return dict(Counter(c.kind for c in self.select(region, backward)))

    def data(self, region=...) -> List[tuple]:
        """(kind, payload) of the data collectives as comm.count_bytes would file them, in
        order, and the all-reduces (comm's handshake is a small int64 one): compare with
        :func:`comm_data` to tell it apart."""
        return [(c.kind, c.payload) for c in self.select(region)
                if c.name in KIND_OF or c.name == "all_reduce"]


def comm_data(counter) -> List[tuple]:
    """(kind, payload) of a ``comm.count_bytes`` counter's records, handshakes included
    (filed there as kind "handshake" with one rank's row, here as the all-reduce of every
    rank's row they run)."""
    return [("all_reduce", r.payload * r.group_size) if r.kind == "handshake"
            else (r.kind, r.payload) for r in counter.records]


_OPEN: List[Collectives] = []
_SAVED: List[tuple] = []   # (module, attribute, original)
_LOCK = threading.Lock()


_DEPTH = threading.local()


def _wrapper(name: str, original):
    def wrapped(*args, **kwargs):
        depth = getattr(_DEPTH, "n", 0)
        if depth == 0:  # one call, once: a collective built on another is not two
            for counter in list(_OPEN):
                counter.record(name, args, kwargs)
        _DEPTH.n = depth + 1
        try:
            return original(*args, **kwargs)
        finally:
            _DEPTH.n = depth

    wrapped.__name__ = name
    wrapped.__wrapped__ = original
    wrapped.__doc__ = original.__doc__
    return wrapped


def _install() -> None:
    originals = {name: getattr(c10d, name) for name in PAYLOAD if hasattr(c10d, name)}
    by_id = {id(fn): name for name, fn in originals.items()}
    wrappers = {name: _wrapper(name, fn) for name, fn in originals.items()}
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attribute, value in list(namespace.items()):
            name = by_id.get(id(value))
            if name is not None and value is originals[name]:
                _SAVED.append((module, attribute, value))
                setattr(module, attribute, wrappers[name])
    for name, original in originals.items():  # a host's own wrapper (MindSpeed's FSDP patches
        current = getattr(dist, name, None)   # all_reduce): it calls the original it holds
        if callable(current) and current is not original and current is not wrappers[name]:
            _SAVED.append((dist, name, current))
            setattr(dist, name, _wrapper(name, current))


def _uninstall() -> None:
    while _SAVED:
        module, attribute, value = _SAVED.pop()
        setattr(module, attribute, value)


@contextlib.contextmanager
def count_collectives(regions=None, everywhere: bool = True):
    """``with count_collectives() as calls:`` records every collective issued inside.

    ``regions``: an object whose ``current()`` names the open code region (the records'
    ``region``), e.g. a :class:`host_syncs.HostSyncs`; ``everywhere=False``: only the
    collectives issued inside a region (a whole training run keeps no record of the rest)."""
    counter = Collectives(regions, everywhere)
    with _LOCK:
        if not _OPEN:
            _install()
        _OPEN.append(counter)
    try:
        yield counter
    finally:
        with _LOCK:
            _OPEN.remove(counter)
            if not _OPEN:
                _uninstall()

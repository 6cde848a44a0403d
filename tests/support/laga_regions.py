"""What LAGA itself does, told apart from its host's code, for the steady-state counters.

A host's training step reads values and runs collectives of its own (the loss, the
gradient norm, the data-parallel reduction); only those LAGA causes count against it.
Two regions of a :class:`host_syncs.HostSyncs` hold them:

- ``laga.forward``: a LAGA forward (the adapter's wrapped forward, a core call), entered by
  whoever calls it: :func:`forward_region` wraps a function;
- ``laga.backward``: the backward of every autograd function LAGA defines (a class of a
  ``mindspeed_laga`` module), which is where its backward collectives and any read it
  makes run; :func:`backward_regions` files them there for the duration of a block.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.autograd.function import BackwardCFunction

FORWARD, BACKWARD = "laga.forward", "laga.backward"
PACKAGES = ("mindspeed_laga",)


def is_laga(cls) -> bool:
    return (getattr(cls, "__module__", "") or "").split(".")[0] in PACKAGES


def forward_region(syncs, fn, name: str = FORWARD):
    """``fn`` run inside ``syncs.region(name)``."""
    @functools.wraps(fn)
    def inside(*args, **kwargs):
        with syncs.region(name):
            return fn(*args, **kwargs)
    return inside


@contextlib.contextmanager
def backward_regions(syncs, name=BACKWARD):
    """Every LAGA autograd function's backward runs inside ``syncs.region(name)`` (``name``:
    a string, or a function returning the region's name at the time, e.g. by step).

    The engine calls ``BackwardCFunction.apply`` on the node of any Python autograd
    function, whenever its module was imported, so patching it there sees them all."""
    original = BackwardCFunction.apply

    def apply(self, *args):
        if is_laga(getattr(self, "_forward_cls", None)):
            with syncs.region(name() if callable(name) else name):
                return original(self, *args)
        return original(self, *args)

    BackwardCFunction.apply = apply
    try:
        yield
    finally:
        BackwardCFunction.apply = original


def assert_patchable() -> None:
    """The engine reaches a Python function's backward through ``BackwardCFunction.apply``
    (what :func:`backward_regions` relies on): check it on this torch."""
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, grad):
            return grad

    original = BackwardCFunction.apply

    def apply(self, *args):
        seen.append(self._forward_cls)
        return original(self, *args)

    BackwardCFunction.apply = apply
    try:
        Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()
    finally:
        BackwardCFunction.apply = original
    assert seen == [Probe], seen

"""The kernels by name, in ``kernel="auto"``'s order of preference.

Adding a kernel: a :class:`~mindspeed_laga.kernels.base.Kernel` subclass in its
own ``kernels/<backend>.py`` and one line in ``_REGISTERED``.
"""
from __future__ import annotations

from typing import Dict, Type

from .base import Kernel
from .eager import Eager
from .npu import Npu
from .sdpa import Sdpa

_REGISTERED = (
    Npu,
    Sdpa,
    Eager,
)
KERNEL_TYPES: Dict[str, Type[Kernel]] = {k.name: k for k in _REGISTERED}


def kernel_for(kernel, pad_v: bool = False) -> Kernel:
    """A kernel object from its name (or the object itself), ``pad_v`` bound."""
    if isinstance(kernel, Kernel):
        return kernel
    if kernel not in KERNEL_TYPES:
        raise ValueError(f"kernel={kernel!r} is unknown; use one of {('auto',) + tuple(KERNEL_TYPES)}")
    return KERNEL_TYPES[kernel](pad_v=pad_v)


def resolve(kernel: str, device, dtype=None, blockwise: bool = False, pad_v: bool = False) -> Kernel:
    """'auto' -> the first registered kernel that picks these tensors; every kernel then
    checks it can run them (ValueError naming the fix)."""
    if kernel == "auto":
        kernel = next(k.name for k in _REGISTERED if k.picks_auto(device, dtype, blockwise))
    found = kernel_for(kernel, pad_v)
    found.check(device, dtype, blockwise)
    return found

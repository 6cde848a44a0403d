"""The kernels by name, in ``kernel="auto"``'s order of preference: the one place a kernel is named.

Adding a kernel: a :class:`~mindspeed_laga.kernels.base.Kernel` subclass in its
own ``kernels/declared/<name>.py`` and one line in ``_REGISTERED``. Validation, the
CLI's choices, the cost model's kind, the doctor, the training flags and the
tests' kernel axis all read the lists below; what a command offers is the
kernel's own property (``device``, ``in_training_flag``, ``aliases``). Torch-free: only
declarations are imported here (``mindspeed-laga --help`` reads these lists).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, Optional, Tuple, Type

from .base import Kernel
from .declared.eager import Eager
from .declared.npu import Npu
from .declared.sdpa import Sdpa

_REGISTERED = (
    Npu,
    Sdpa,
    Eager,
)
KERNEL_TYPES: Dict[str, Type[Kernel]] = {k.name: k for k in _REGISTERED}
# The names in the CLI's order, the most general first (auto's order reversed).
KERNEL_NAMES: Tuple[str, ...] = tuple(reversed(KERNEL_TYPES))
# What a caller may ask for.
KERNELS: Tuple[str, ...] = ("auto",) + KERNEL_NAMES
# Those that run on CPU tensors (what the commands spawning gloo CPU ranks offer).
CPU_KERNELS: Tuple[str, ...] = tuple(n for n in KERNEL_NAMES if KERNEL_TYPES[n].device is None)
# What MindSpeed-LLM's --mla-laga-kernel offers.
TRAINING_KERNELS: Tuple[str, ...] = ("auto",) + tuple(n for n in KERNEL_NAMES
                                                       if KERNEL_TYPES[n].in_training_flag)
ALIASES: Dict[str, str] = {a: k.name for k in _REGISTERED for a in k.aliases}
_CLASHES = sorted(set(ALIASES) & set(KERNEL_TYPES)) + sorted(
    a for a in ALIASES if sum(a in k.aliases for k in _REGISTERED) > 1)
if _CLASHES:  # a flag value must mean one kernel
    raise ValueError(f"kernel aliases {_CLASHES} name another kernel or two kernels; "
                     "rename them in the kernels' ``aliases``")


def canonical(name: str) -> str:
    """A CLI flag's kernel name with an older spelling replaced by the registry's
    (argparse ``type=``: its ``choices`` then check the result)."""
    return ALIASES.get(name, name)


def device_of(kernel: str) -> Optional[str]:
    """The one device type ``kernel`` runs on (None: any, or "auto")."""
    found = KERNEL_TYPES.get(kernel)
    return None if found is None else found.device


def model_kind(kernel: str, device_type: str) -> str:
    """The cost model's kernel kind of ``kernel`` run on ``device_type``; ``auto``
    resolves as the forms resolve it (dense path)."""
    if kernel == "auto":
        device = SimpleNamespace(type=device_type)
        kernel = next(k.name for k in _REGISTERED if k.picks_auto(device, None, False))
    return KERNEL_TYPES[kernel].model_kind(device_type)


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

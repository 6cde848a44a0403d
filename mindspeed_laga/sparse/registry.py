"""The sparse MLA (DSA) stage kernels: the one list of them.

``sparse_laga_attention`` picks one per stage (``indexer_kernel``, ``attention_kernel``,
``loss_kernel``); any combination runs. Adding a kernel: a ``SparseKernel`` subclass
(``sparse/stage.py``) in its own ``sparse/<name>_stages.py`` that declares its own
``name`` (a subclass does not take its parent's) and the host flag selecting it per stage
(``host_flags``), its import and one entry in ``_REGISTERED``. Tests and tools enumerate
``SPARSE_KERNELS``; the host adapters map flags through :func:`host_kernels`.
"""
from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional, Sequence, Type

from .npu_stages import SparseNpu
from .stage import STAGES, LossReads, SparseDims, SparseKernel
from .torch_stages import SparseTorch

_REGISTERED = (
    SparseTorch,
    SparseNpu,
)
KERNEL_TYPES: Sequence[Type[SparseKernel]] = _REGISTERED


def _by_name(types) -> Dict[str, Type[SparseKernel]]:
    """name -> class; a class must declare its own name, once in the list."""
    named = {}
    for cls in types:
        name = cls.__dict__.get("name")
        if not name:
            raise TypeError(f"sparse kernel {cls.__name__} must declare its own name")
        if name in named:
            raise TypeError(f"sparse kernel name {name!r} is declared by both "
                            f"{named[name].__name__} and {cls.__name__}")
        named[name] = cls
    return named


_TYPES = _by_name(KERNEL_TYPES)
SPARSE_KERNELS = tuple(_TYPES)
# the host's default at every stage: the first kernel, which no flag selects
HOST_DEFAULT = KERNEL_TYPES[0].name
if KERNEL_TYPES[0].host_flags:
    raise TypeError(f"the first sparse kernel ({HOST_DEFAULT}) is the host's default: it "
                    "declares no host flag")
_UNKNOWN_STAGES = {c.name: sorted(set(c.host_flags) - set(STAGES)) for c in KERNEL_TYPES}
if any(_UNKNOWN_STAGES.values()):
    raise TypeError(f"sparse kernels' host_flags name stages outside {STAGES}: {_UNKNOWN_STAGES}")


def host_kernels(flag_on: Callable[[str, str], bool]) -> Dict[str, str]:
    """``sparse_laga_attention``'s ``<stage>_kernel`` arguments as the host's flags pick:
    per stage the first registered kernel whose flag for it is on (``flag_on(stage,
    flag)``), else :data:`HOST_DEFAULT`."""
    def selected(cls, stage):
        return stage in cls.host_flags and flag_on(stage, cls.host_flags[stage])

    return {f"{stage}_kernel": next((c.name for c in KERNEL_TYPES if selected(c, stage)),
                                    HOST_DEFAULT) for stage in STAGES}


def host_flag_names() -> Dict[str, str]:
    """Every host flag a sparse kernel declares -> the kernel it selects."""
    return {flag: c.name for c in KERNEL_TYPES for flag in c.host_flags.values()}


class SparseStages(NamedTuple):
    indexer: SparseKernel
    attention: SparseKernel
    loss: SparseKernel
    keep: Optional[LossReads]  # what the attention keeps for the loss


def sparse_stages(*, indexer_kernel: str, attention_kernel: str, loss_kernel: str,
                  dims: SparseDims, with_loss: bool, with_indexer: bool = True) -> SparseStages:
    """The three stages' kernels, after checking each that runs can (ValueError naming the
    argument: an unknown name, a missing torch_npu, dims the fused op does not take); the
    indexer runs unless the picks are given (``with_indexer``). Runs no collective."""
    chosen = {"indexer": ("indexer_kernel", indexer_kernel),
              "attention": ("attention_kernel", attention_kernel),
              "loss": ("loss_kernel", loss_kernel)}
    kernels = {}
    for stage, (argument, name) in chosen.items():
        kernels[stage] = sparse_kernel(name, argument)
        if {"indexer": with_indexer, "loss": with_loss}.get(stage, True):
            kernels[stage].check(stage, argument, dims)
    return SparseStages(kernels["indexer"], kernels["attention"], kernels["loss"],
                        kernels["loss"].loss_reads if with_loss else None)


def sparse_kernel(name: str, argument: str = "kernel") -> SparseKernel:
    """The kernel named ``name`` (ValueError naming ``argument`` and the choices)."""
    if not isinstance(name, str) or name not in _TYPES:
        raise ValueError(f"{argument}={name!r} is unknown; use one of {SPARSE_KERNELS}")
    return _TYPES[name]()


def kernel_index(name: str) -> int:
    """The kernel's place in SPARSE_KERNELS (what ranks agree on)."""
    return SPARSE_KERNELS.index(name)

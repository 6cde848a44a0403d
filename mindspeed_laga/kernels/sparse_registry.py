"""The sparse MLA (DSA) kernels by name: the one place their names live.

``sparse_laga_attention`` picks one per stage (``indexer_kernel``, ``attention_kernel``,
``loss_kernel``); any combination runs. Adding a kernel: a ``SparseKernel`` subclass
(``kernels/sparse_base.py``) in its own ``kernels/sparse_<name>.py``, its name below and
its class in ``_TYPES`` in the same order.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from .sparse_base import SparseKernel
from .sparse_npu import SparseNpu
from .sparse_torch import SparseTorch

SPARSE_KERNELS = ("torch", "npu")
_TYPES = dict(zip(SPARSE_KERNELS, (SparseTorch, SparseNpu)))


class SparseStages(NamedTuple):
    indexer: SparseKernel
    attention: SparseKernel
    loss: SparseKernel
    keep: Optional[str]  # what the attention keeps for the loss ("probs" or "stats")


def sparse_stages(*, indexer_kernel: str, attention_kernel: str, loss_kernel: str,
                  dims: dict, with_loss: bool) -> SparseStages:
    """The three stages' kernels, after checking each can run (ValueError naming the
    argument: an unknown name, a missing torch_npu, dims the fused op does not take).
    ``dims``: the last dims of kv_latent, k_pos_emb and index_key, the query's heads
    ("heads"; "loss heads": those of every rank of loss_tp_group), the index heads and
    index_topk.
    Runs no collective."""
    chosen = {"indexer": ("indexer_kernel", indexer_kernel),
              "attention": ("attention_kernel", attention_kernel),
              "loss": ("loss_kernel", loss_kernel)}
    kernels = {}
    for stage, (argument, name) in chosen.items():
        kernels[stage] = sparse_kernel(name, argument)
        if stage != "loss" or with_loss:
            kernels[stage].check(stage, argument, dims)
    return SparseStages(kernels["indexer"], kernels["attention"], kernels["loss"],
                        kernels["loss"].loss_reads if with_loss else None)


def sparse_kernel(name: str, argument: str = "kernel") -> SparseKernel:
    """The kernel named ``name`` (ValueError naming ``argument`` and the choices)."""
    if name not in _TYPES:
        raise ValueError(f"{argument}={name!r} is unknown; use one of {SPARSE_KERNELS}")
    return _TYPES[name]()

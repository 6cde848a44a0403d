"""Block kernel on PyTorch's fused attention ops (CPU flash, CUDA memory-efficient).

The blockwise LAGA hands a block kernel query rows and one rebuilt key block
(see ``block_kernels``). After the block walk has cut rows that see nothing,
a causal block's visibility is a diagonal offset ``o >= 0``: key ``j`` is
visible to row ``i`` iff ``j <= i + o``. Keys ``[0, o)`` are then visible to
every row and keys ``[o, B)`` follow a top-left causal mask relative to the
rows: one fused call (no mask, or top-left causal when ``o == 0``) or two
merged by log-sum-exp, no dense mask (``kernels/sdpa.py`` has the recipe and
the ops). Backward runs the same calls with the *final* output and
log-sum-exp, which makes each call's probabilities the global ones.

- CPU: ``_scaled_dot_product_flash_attention_for_cpu`` and its backward
  (float64, float32, bfloat16; the narrower head dim zero-padded for the call).
- CUDA: ``_efficient_attention_forward`` / ``_efficient_attention_backward``
  (any d_qk, d_v). Why this one and not flash or cuDNN: docs/BEYOND.md.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels.precision import acc_dtype

from ..kernels.sdpa import CpuFlash, CudaEfficient, fused_backward, fused_forward

# Which op pair runs a block, by device type (scripts/cuda_block_kernels.py swaps the
# CUDA entry to compare candidates).
BACKENDS = {"cpu": CpuFlash, "cuda": CudaEfficient}


def diagonal_offset(visibility) -> Optional[int]:
    """A block's visibility -> its causal diagonal (None = every key visible).

    Takes the diagonal itself (an int ``c``: key ``j`` visible to row ``i`` iff
    ``j <= i + c``) or the [rows, B] bool keep-mask of that staircase, in which
    row 0 sees exactly ``c + 1`` keys.
    """
    if visibility is None or isinstance(visibility, int):
        return visibility
    return int(visibility[0].sum()) - 1


def backend_for(device: torch.device):
    if device.type not in BACKENDS:
        raise ValueError(f"kernel='sdpa' with recompute_kv has fused block ops for "
                         f"{sorted(BACKENDS)} tensors, not {device.type!r}; use kernel='eager' "
                         "(or 'npu' on Ascend)")
    return BACKENDS[device.type]


class FusedBlock:
    """Block kernel on fused attention ops: no score matrix, one or two calls a block."""

    @staticmethod
    def forward(q, key, value, visibility, scale):
        out, lse = fused_forward(backend_for(q.device), q, key, value, diagonal_offset(visibility),
                                 scale)
        acc = acc_dtype(q.dtype)
        return out.to(acc), lse.to(acc)

    @staticmethod
    def backward(q, key, value, visibility, scale, d_out, out, lse):
        return fused_backward(backend_for(q.device), q, key, value, diagonal_offset(visibility), scale,
                              d_out.to(q.dtype), out.to(q.dtype), lse)

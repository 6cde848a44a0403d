"""Attention kernels behind one call.

``attend(q, k, v, scale=..., segments=..., causal=..., kernel=...)``:

- ``q`` [b, n, s_q, d_qk]: queries, made of consecutive-position *segments*
  ``(local_start, length, global_start)`` (see ``layout.segments``).
- ``k`` [b, n_k, S, d_qk], ``v`` [b, n_k, S, d_v]: keys in global position
  order starting at position 0; ``n_k`` is ``n`` or 1 (the absorbed form uses
  one key/value head shared by all query heads).
- returns [b, n, s_q, d_v].

With ``causal`` a query at global position p sees keys ``[0, p]``: each
segment is attended against the key prefix ``[0, global_start + length)``
with a bottom-right-aligned causal mask. Slicing to the prefix is exact (the
cut keys are masked anyway) and is the tested recipe for the NPU kernel.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from ..vocab import Segment, key_prefix
from . import eager, npu, sdpa
from .masks import causal_keep_mask  # noqa: F401  (re-exported)

_KERNELS = {"eager": eager.attend_segment, "sdpa": sdpa.attend_segment, "npu": npu.attend_segment}


def attend(q, k, v, *, scale: float, segments: List[Segment], causal: bool, kernel: str,
           epilogue: Optional[Callable] = None):
    """``epilogue`` maps each segment's output before the segments are concatenated
    (so an op that keeps its input for backward keeps the kernel's own output)."""
    fn = _KERNELS[kernel]
    outs = []
    for seg in segments:
        local_start, length, _ = seg
        end = key_prefix(seg, k.shape[2], causal)
        out = fn(q[:, :, local_start:local_start + length], k[:, :, :end], v[:, :, :end],
                 scale=scale, causal=causal)
        outs.append(out if epilogue is None else epilogue(out))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

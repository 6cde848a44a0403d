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

from functools import partial
from typing import Callable, List, Optional

import torch

from ..layout import Segment
from . import eager, npu, sdpa

_KERNELS = {"eager": eager.attend_segment, "sdpa": sdpa.attend_segment, "npu": npu.attend_segment}


def causal_keep_mask(q_len: int, k_len: int, device) -> torch.Tensor:
    """[q_len, k_len] bool, True = visible: bottom-right-aligned causal."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)


def key_prefix(seg: Segment, total: int, causal: bool) -> int:
    """How many position-ordered keys a segment can see."""
    _, length, start = seg
    return start + length if causal else total


def attend(q, k, v, *, scale: float, segments: List[Segment], causal: bool, kernel: str,
           epilogue: Optional[Callable] = None, pad_v: bool = False):
    """``epilogue`` maps each segment's output before the segments are concatenated
    (so an op that keeps its input for backward keeps the kernel's own output).
    ``pad_v``: kernel "npu" zero-pads V to the q/k head dim (the others ignore it)."""
    fn = _KERNELS[kernel]
    if kernel == "npu":
        fn = partial(fn, pad_v=pad_v)
    outs = []
    for seg in segments:
        local_start, length, _ = seg
        end = key_prefix(seg, k.shape[2], causal)
        out = fn(q[:, :, local_start:local_start + length], k[:, :, :end], v[:, :, :end],
                 scale=scale, causal=causal)
        outs.append(out if epilogue is None else epilogue(out))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

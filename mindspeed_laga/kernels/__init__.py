"""Attention kernels behind one call.

``attend(q, k, v, scale=..., segments=..., causal=..., kernel=...)``:

- ``q`` [b, n, s_q, d_qk]: queries, made of consecutive-position *segments*
  ``(local_start, length, global_start)`` (see ``vocab/segments.py``).
- ``k`` [b, n_k, S, d_qk], ``v`` [b, n_k, S, d_v]: keys in global position
  order starting at position 0; ``n_k`` is ``n`` or 1 (the absorbed form uses
  one key/value head shared by all query heads).
- returns [b, n, s_q, d_v].

With ``causal`` a query at global position p sees keys ``[0, p]``: each
segment is attended against the key prefix ``[0, global_start + length)``
with a bottom-right-aligned causal mask. Slicing to the prefix is exact (the
cut keys are masked anyway) and is the tested recipe for the NPU kernel.

With documents (``cu_seqlens``) a query sees only keys of its own document:
each segment is attended against its key window (from the start of its first
query's document) in one kernel call, told the segment's *pieces* (one per
document it crosses: query rows and their key range, causal within the piece
bottom-right aligned). Eager and SDPA turn the pieces into a mask of the
segment; the NPU kernel packs them as varlen sequences (layout TND).
"""
from __future__ import annotations

from functools import partial
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..vocab.documents import doc_pieces, document_of
from ..vocab.keys import key_window
from ..vocab.segments import Documents, Segment
from . import eager, npu, sdpa
from .masks import Piece

_KERNELS = {"eager": eager.attend_segment, "sdpa": sdpa.attend_segment, "npu": npu.attend_segment}


def attend(q, k, v, *, scale: float, segments: List[Segment], causal: bool, kernel: str,
           epilogue: Optional[Callable] = None, documents: Documents = None,
           key_ranges: Optional[Sequence[Tuple[int, int]]] = None, pad_v: bool = False):
    """``epilogue`` maps each segment's output before the segments are concatenated
    (so an op that keeps its input for backward keeps the kernel's own output).

    ``documents``: cu_seqlens; a query sees only keys of its own document.
    ``key_ranges``: the position ranges ``k`` holds, in order (None: ``[0, S)``).
    ``pad_v``: kernel "npu" zero-pads V to the q/k head dim (the others ignore it).
    """
    fn = _KERNELS[kernel]
    if kernel == "npu":
        fn = partial(fn, pad_v=pad_v)
    keys = KeyIndex(key_ranges, k.shape[2])
    outs = []
    for seg in segments:
        local_start, length, _ = seg
        lo, hi = key_window(seg, keys.total, causal, documents)
        lo_i, hi_i = keys.index(lo), keys.index(lo) + (hi - lo)
        extra = {} if documents is None else {"pieces": _relative_pieces(seg, lo, causal, documents)}
        out = fn(q[:, :, local_start:local_start + length], k[:, :, lo_i:hi_i], v[:, :, lo_i:hi_i],
                 scale=scale, causal=causal, **extra)
        outs.append(out if epilogue is None else epilogue(out))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _relative_pieces(seg: Segment, lo: int, causal: bool, documents) -> List[Piece]:
    """The segment's document pieces as (query start, query length, key start, key end),
    relative to the segment and to its key window starting at position ``lo``."""
    local0 = seg[0]
    out = []
    for local, n, g in doc_pieces(seg, documents):
        d = document_of(g, documents)
        end = g + n if causal else documents[d + 1]
        out.append((local - local0, n, documents[d] - lo, end - lo))
    return out


class KeyIndex:
    """Where a key position sits in a key tensor holding ``ranges`` of positions."""

    def __init__(self, ranges: Optional[Sequence[Tuple[int, int]]], num_keys: int):
        self.ranges = list(ranges) if ranges else [(0, num_keys)]
        self.total = self.ranges[-1][1]

    def index(self, pos: int) -> int:
        before = 0
        for lo, hi in self.ranges:
            if lo <= pos < hi or pos == hi == self.total:
                return before + pos - lo
            before += hi - lo
        raise ValueError(f"key position {pos} is outside the rebuilt key ranges {self.ranges}")

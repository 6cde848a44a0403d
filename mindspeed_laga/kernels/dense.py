"""Attention kernels behind one call (``kernels.attend``).

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

With key padding (``key_padding`` [b, S], True = padding key, position order)
each segment's visibility is its causal/document visibility minus the padding
keys of its window, one [b, 1, rows, W] bool mask per segment handed to the
kernel (``masks.padded_keep_mask``). A row that sees no key at all (left
padding's pad rows) returns ``empty_fill`` (zero when None) and passes no
gradient to the keys: the kernel runs it with its window visible and its
output is replaced.

A non-finite key or value reaches only the rows that see it, whatever the
kernel (``nonfinite.py``): such positions are zeroed before the kernel runs
and the rows that see them set to NaN after.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..vocab.documents import doc_pieces, document_of
from ..vocab.keys import key_window
from ..vocab.segments import Documents, Segment
from . import nonfinite
from .masks import Piece, padded_keep_mask
from .registry import kernel_for


def attend(q, k, v, *, scale: float, segments: List[Segment], causal: bool, kernel,
           epilogue: Optional[Callable] = None, documents: Documents = None,
           key_ranges: Optional[Sequence[Tuple[int, int]]] = None, pad_v: bool = False,
           own_kv: bool = False, bad: Optional[torch.Tensor] = None,
           key_padding: Optional[torch.Tensor] = None, empty_fill: Optional[torch.Tensor] = None):
    """``epilogue`` maps each segment's output before the segments are concatenated
    (so an op that keeps its input for backward keeps the kernel's own output).

    ``documents``: cu_seqlens; a query sees only keys of its own document.
    ``key_ranges``: the position ranges ``k`` holds, in order (None: ``[0, S)``).
    ``kernel``: the :class:`~mindspeed_laga.kernels.base.Kernel` the setup resolved (or a
    kernel name, with ``pad_v``: kernel "npu" zero-pads V to the q/k head dim, the
    others ignore it).
    ``own_kv``: ``k`` and ``v`` were made by the caller for this call (nothing else
    reads them), so non-finite positions are zeroed in place instead of in a copy.
    ``bad``: [b, n_k, S], True = non-finite, when the caller found and zeroed them itself.
    ``key_padding``: [b, S] bool over every position 0 ... S (True = padding key);
    ``empty_fill``: [b, n|1, 1, d_v], what a row seeing no key returns (None: zero).
    """
    kernel = kernel_for(kernel, pad_v)
    nan_at = None  # bad as 0 / NaN floats, while it is exactly ``bad``
    if bad is None:
        nan_at = nonfinite.nan_positions(k, v)  # [b, n_k, S]
        bad = nan_at.isnan()
        k = nonfinite.zero_bad_positions(k, bad, own_kv)
        v = nonfinite.zero_bad_positions(v, bad, own_kv)
    pad = None if key_padding is None else held_keys(key_padding, key_ranges)  # [b, K]
    if pad is not None:  # an invisible padding key poisons no row
        bad, nan_at = bad & ~pad[:, None, :], None
    windows = _windows(tuple(segments), key_ranges, k.shape[2], causal, documents)
    out = None
    if causal and pad is None and documents is None:  # the kernel may take all rows at once
        out = kernel.attend_rows(q, k, v, scale=scale, windows=windows)
    if out is None:
        outs = _per_segment(kernel, q, k, v, scale, causal, segments, windows, pad, empty_fill,
                            epilogue)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    elif epilogue is not None:
        out = epilogue(out)
    return out + nonfinite.row_poison(bad, windows, causal, out.dtype, nan_at)


def _per_segment(kernel, q, k, v, scale, causal, segments, windows, pad, empty_fill, epilogue):
    """Each segment's output, one kernel call each (with key padding, its rows that see no
    key replaced by ``empty_fill``), mapped by ``epilogue``."""
    outs = []
    for (local_start, length, _), (_, lo_i, hi_i, pieces) in zip(segments, windows):
        extra = {} if pieces is None else {"pieces": list(pieces)}
        empty = None
        if pad is not None:
            keep, empty = padded_keep_mask(length, pad[:, lo_i:hi_i], causal, pieces)
            extra = {"keep": keep}
        out = kernel.attend_segment(q[:, :, local_start:local_start + length],
                                    k[:, :, lo_i:hi_i], v[:, :, lo_i:hi_i], scale=scale,
                                    causal=causal, **extra)
        if empty is not None:
            fill = out.new_zeros(()) if empty_fill is None else empty_fill.to(out.dtype)
            out = torch.where(empty, fill, out)
        outs.append(out if epilogue is None else epilogue(out))
    return outs


def held_keys(key_padding: torch.Tensor, key_ranges) -> torch.Tensor:
    """[b, S] padding over every position -> [b, K] over the positions a key tensor
    holding ``key_ranges`` holds (all of them when None)."""
    if not key_ranges:
        return key_padding
    return torch.cat([key_padding[:, lo:hi] for lo, hi in key_ranges], dim=1)


def _windows(segments: Tuple[Segment, ...], key_ranges, num_keys: int, causal: bool,
             documents) -> Tuple[nonfinite.Window, ...]:
    """Per query segment: its rows, its key window start and end as indices of the key
    tensor, its document pieces relative to the window or None (made once per layout)."""
    return _cached_windows(segments, None if not key_ranges else tuple(map(tuple, key_ranges)),
                           num_keys, causal, None if documents is None else tuple(documents))


@lru_cache(maxsize=256)
def _cached_windows(segments, key_ranges, num_keys: int, causal: bool, documents):
    keys = KeyIndex(key_ranges, num_keys)
    windows = []
    for seg in segments:
        lo, hi = key_window(seg, keys.total, causal, documents)
        lo_i = keys.index(lo)
        pieces = None if documents is None else tuple(_relative_pieces(seg, lo, causal, documents))
        windows.append(nonfinite.Window(seg[1], lo_i, lo_i + (hi - lo), pieces))
    return tuple(windows)


def poison_rows(bad: torch.Tensor, *, segments: List[Segment], causal: bool, documents=None,
                key_ranges=None, dtype) -> torch.Tensor:
    """[b, n_k, s_q, 1] of 0 or NaN: NaN for the query rows that see a key of ``bad``
    ([b, n_k, S], True = non-finite), the rows of every segment in order (what
    :func:`attend` adds to its output; the blockwise path adds it to its own)."""
    windows = _windows(tuple(segments), key_ranges, bad.shape[-1], causal, documents)
    return nonfinite.row_poison(bad, windows, causal, dtype)


def _relative_pieces(seg: Segment, lo: int, causal: bool, documents) -> List[Piece]:
    """The segment's document pieces as (query start, query length, key start, key end),
    relative to the segment and to its key window starting at position ``lo``."""
    local0, _, _ = seg
    out = []
    for local, n, g in doc_pieces(seg, documents):
        d = document_of(g, documents)
        end = g + n if causal else documents[d + 1]
        out.append(Piece(local - local0, n, documents[d] - lo, end - lo))
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

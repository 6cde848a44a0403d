"""Which position-ordered keys a query segment sees, and how keys are cut into blocks."""
from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

from .documents import document_of
from .segments import Documents, Segment


def key_window(seg: Segment, total: int, causal: bool, documents: Documents = None) -> Tuple[int, int]:
    """[lo, hi): the position-ordered keys some query of ``seg`` can see.

    Without documents lo is 0; with them it is the start of the first query's
    document and (non-causal) hi the end of the last query's document.
    """
    _, length, g = seg
    if documents is None:
        return 0, key_prefix(seg, total, causal)
    lo = documents[document_of(g, documents)]
    hi = g + length if causal else documents[document_of(g + length - 1, documents) + 1]
    return lo, hi


def key_prefix(seg: Segment, total: int, causal: bool) -> int:
    """How many position-ordered keys (from position 0) a segment can see."""
    _, length, start = seg
    return start + length if causal else total


def visible_keys(segments: Iterable[Segment], total: int, causal: bool) -> int:
    """Keys [0, end) that at least one of the segments' queries sees."""
    return max(key_prefix(seg, total, causal) for seg in segments)


def key_ranges(segments: Iterable[Segment], total: int, causal: bool,
               documents: Documents = None) -> List[Tuple[int, int]]:
    """Sorted, disjoint [lo, hi) position ranges holding every key some query sees
    (without documents: the one prefix [0, visible_keys))."""
    windows = sorted(key_window(seg, total, causal, documents) for seg in segments)
    merged: List[List[int]] = []
    for lo, hi in windows:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def key_blocks(num_keys: int, block_size: Optional[int]) -> List[Tuple[int, int]]:
    """Key blocks [k0, k1) in position order; None: one block of every key."""
    size = block_size or max(num_keys, 1)
    return [(k0, min(k0 + size, num_keys)) for k0 in range(0, num_keys, size)]

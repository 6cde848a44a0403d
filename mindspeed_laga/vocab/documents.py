"""Packed documents (``cu_seqlens``): checking the boundaries, cutting segments at them."""
from __future__ import annotations

import bisect
from typing import List, Tuple

from .segments import Documents, Segment


def check_documents(cu_seqlens, seq_len: int, layout: str, cp_size: int) -> Tuple[int, ...]:
    """cu_seqlens as a tuple of ints, checked (ValueError naming the fix)."""
    try:
        bounds = tuple(int(x) for x in cu_seqlens)
        exact = all(int(x) == x and not isinstance(x, bool) for x in cu_seqlens)
    except (TypeError, ValueError):
        raise ValueError("cu_seqlens must be a 1-D integer tensor or a list of ints (document "
                         f"boundaries 0 ... sequence length), got {cu_seqlens!r}") from None
    if not exact or len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seq_len:
        raise ValueError(f"cu_seqlens must hold integer document boundaries from 0 to the full "
                         f"sequence length (local length x CP = {seq_len}), got {list(bounds)}")
    if any(b <= a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must increase strictly (every document non-empty), got "
                         f"{list(bounds)}")
    if layout == "doc_zigzag" and cp_size > 1:
        bad = [b - a for a, b in zip(bounds[:-1], bounds[1:]) if (b - a) % (2 * cp_size)]
        if bad:
            raise ValueError(
                f"layout='doc_zigzag' cuts every document into 2*CP={2 * cp_size} equal chunks; "
                f"document lengths {bad} are not divisible by {2 * cp_size}: pad each document "
                f"to a multiple of {2 * cp_size} (as MindSpeed pads EOD-separated documents "
                "under --reset-attention-mask) or use layout='zigzag'/'contiguous'")
    return bounds


def resolve_documents(cu_seqlens, seq_len: int, layout: str, cp_size: int,
                      ulysses_degree: int = 1) -> Documents:
    """cu_seqlens (a sequence of ints, or None) -> the checked global boundaries or None,
    with the layout's needs: doc_zigzag needs documents and has no hybrid form."""
    if layout == "doc_zigzag" and ulysses_degree > 1:
        raise ValueError("layout='doc_zigzag' has no hybrid form: with cp_algo='hybrid' "
                         "(ulysses_degree > 1) use layout='zigzag' or 'contiguous' "
                         "(cu_seqlens still applies)")
    if cu_seqlens is None:
        if layout == "doc_zigzag":
            raise ValueError("layout='doc_zigzag' needs cu_seqlens= (the global document "
                             "boundaries); without documents use layout='zigzag'")
        return None
    return check_documents(cu_seqlens, seq_len, layout, cp_size)


def document_of(pos: int, documents: Tuple[int, ...]) -> int:
    """Index of the document holding global position ``pos``."""
    return bisect.bisect_right(documents, pos) - 1


def doc_pieces(seg: Segment, documents: Documents) -> List[Segment]:
    """A segment cut at document boundaries (one piece when there are no documents)."""
    if documents is None:
        return [seg]
    local, length, g = seg
    out = []
    while length:
        end = documents[document_of(g, documents) + 1]
        n = min(length, end - g)
        out.append((local, n, g))
        local, length, g = local + n, length - n, g + n
    return out

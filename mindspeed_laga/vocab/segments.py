"""Which global positions each CP rank holds: the chunk rule and *segments*.

A segment is a run of local tokens with consecutive global positions,
``(local_start, length, global_start)``; see docs/DESIGN.md, section "Layouts".
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Tuple

from .names import LAYOUTS


class Segment(NamedTuple):
    """A run of local tokens with consecutive global positions."""
    local_start: int
    length: int
    global_start: int


Documents = Optional[Tuple[int, ...]]  # cu_seqlens: global document boundaries, 0 ... S


def num_chunks(layout: str, cp_size: int) -> int:
    """How many equal pieces the full sequence (zigzag, contiguous) or each document
    (doc_zigzag) is cut into: 2P or P."""
    return 2 * cp_size if layout in ("zigzag", "doc_zigzag") and cp_size > 1 else cp_size


def seq_multiple(layout: str, cp_size: int, ulysses_degree: int = 1) -> int:
    """The full sequence length must be a multiple of this.

    Hybrid zigzag (``ulysses_degree`` U > 1): 2R chunks (R = P/U) whose pairs
    are cut into U equal pieces, i.e. a multiple of lcm(2R, P).
    """
    if ulysses_degree == 1 or layout != "zigzag":
        return num_chunks(layout, cp_size)
    ring = cp_size // ulysses_degree
    return 2 * ring * cp_size // math.gcd(2 * ring, cp_size)


def check_seq_len(seq_len: int, layout: str, cp_size: int, *, ulysses_degree: int = 1) -> None:
    """The full sequence must cut into equal chunks (ValueError naming the padding)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; use one of {LAYOUTS}")
    if ulysses_degree < 1 or cp_size % ulysses_degree:
        raise ValueError(f"ulysses_degree={ulysses_degree} must be a positive divisor of "
                         f"CP={cp_size}")
    multiple = seq_multiple(layout, cp_size, ulysses_degree)
    if seq_len % multiple:
        why = ("2*CP" if multiple == 2 * cp_size else "CP") if ulysses_degree == 1 else \
            f"hybrid zigzag, CP={cp_size}, ulysses_degree={ulysses_degree}"
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {multiple} "
            f"({why} for layout={layout!r}, CP={cp_size}); pad it to a multiple of {multiple}")


def rank_segments(layout: str, cp_size: int, rank: int, local_len: int,
                  documents: Documents = None, *, ulysses_degree: int = 1) -> List[Segment]:
    """The consecutive-position runs of rank ``rank``'s ``local_len`` tokens.

    ``documents`` (cu_seqlens) is needed by ``doc_zigzag`` only.
    ``ulysses_degree`` U > 1: hybrid CP, rank = r*U + u (r: ring rank, u:
    Ulysses rank). ``contiguous`` is unchanged (MindSpeed's general hybrid
    split); ``zigzag`` cuts the sequence into 2R chunks (R = P/U), ring rank r
    takes chunks r and 2R-1-r, and that pair is cut contiguously into U
    pieces, piece u on Ulysses rank u (MindSpeed's hybrid_cp_algo batch).
    """
    if cp_size == 1:
        return [Segment(0, local_len, 0)]
    if layout == "contiguous":
        return [Segment(0, local_len, rank * local_len)]
    if layout == "doc_zigzag":
        return _doc_zigzag_segments(cp_size, rank, documents)
    if ulysses_degree > 1:
        ring, u = divmod(rank, ulysses_degree)
        pair = rank_segments(layout, cp_size // ulysses_degree, ring, ulysses_degree * local_len)
        return _cut(pair, u * local_len, local_len)
    c = local_len // 2
    return [Segment(0, c, rank * c), Segment(c, c, (2 * cp_size - 1 - rank) * c)]


def _doc_zigzag_segments(cp_size: int, rank: int, documents: Documents) -> List[Segment]:
    """Every document cut into 2P chunks; rank r holds chunks r and 2P-1-r of each,
    documents in order (MindSpeed's megatron_cp split of EOD-padded batches)."""
    if documents is None:
        raise ValueError("layout='doc_zigzag' needs cu_seqlens= (the document boundaries)")
    out, local = [], 0
    for start, end in zip(documents[:-1], documents[1:]):
        c = (end - start) // (2 * cp_size)
        for chunk in (rank, 2 * cp_size - 1 - rank):
            out.append(Segment(local, c, start + chunk * c))
            local += c
    return out


def _cut(segments: List[Segment], start: int, length: int) -> List[Segment]:
    """The segments of local tokens [start, start + length), renumbered from 0."""
    out = []
    for ls, n, g in segments:
        lo, hi = max(ls, start), min(ls + n, start + length)
        if lo < hi:
            out.append(Segment(lo - start, hi - lo, g + lo - ls))
    return out


def query_segments(layout: str, cp_size: int, rank: int, local_len: int,
                   split_heads: bool, documents: Documents = None, *,
                   ulysses_degree: int = 1) -> List[Segment]:
    """Segments of the queries a rank attends.

    Local queries: this rank's own tokens. Heads split: the tokens of every
    rank of the split group in rank order, as the all-to-all delivers them
    (ulysses: the CP group; hybrid, ``ulysses_degree`` U > 1: the U
    consecutive ranks holding ``rank``).
    """
    if not split_heads:
        return rank_segments(layout, cp_size, rank, local_len, documents,
                             ulysses_degree=ulysses_degree)
    s = local_len
    if ulysses_degree > 1:
        first, members = rank - rank % ulysses_degree, ulysses_degree
    else:
        first, members = 0, cp_size
    return [Segment(i * s + ls, n, g) for i in range(members)
            for ls, n, g in rank_segments(layout, cp_size, first + i, s, documents,
                                          ulysses_degree=ulysses_degree)]

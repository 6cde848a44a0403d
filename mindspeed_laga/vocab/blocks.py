"""The blockwise walk's row policy: how many query rows a row block takes, and which segments join."""
from __future__ import annotations

from typing import Iterable, List, Optional

from .segments import Segment

# Query rows per row block of the blockwise walk, in keys per block. Each row block
# rebuilds the K/V of the key blocks it sees, so rows per block trade rebuild work
# (about ``(S / rows + 1) / 2`` rebuilds of every key, causal) against the float32
# accumulators that live for one row block (dq in backward, the output in forward).
QUERY_BLOCK_KEYS = 2

# The eager block kernel's scores of one block are float32 [b, heads, rows, B]; heads
# are taken a few at a time so the transient scores/probabilities stay near this many
# elements (kernels/eager.py runs it, the cost model's peak counts it).
SCORE_CHUNK_ELEMENTS = 1 << 25


def query_block_rows(block_size: Optional[int]) -> Optional[int]:
    """Query rows a blockwise walk takes at once; None (one block of keys): whole segments."""
    return None if block_size is None else QUERY_BLOCK_KEYS * block_size


def join_adjacent(segments: Iterable[Segment]) -> List[Segment]:
    """Segments with each one that continues the previous (next local row, next position)
    joined to it: ulysses' contiguous layout delivers every rank's tokens as one segment
    each, in position order; the blockwise walk cuts its row blocks from the joined runs
    so that the row blocks, not the ranks, set how often keys are rebuilt."""
    out: List[Segment] = []
    for local, n, g in segments:
        last = out[-1] if out else None
        if last and last.local_start + last.length == local and last.global_start + last.length == g:
            out[-1] = Segment(out[-1].local_start, out[-1].length + n, out[-1].global_start)
        else:
            out.append(Segment(local, n, g))
    return out

"""Which (query, key) pairs and keys a rank works on, in closed form.

Every count here is O(segments) (the blockwise walk's: O(row blocks)), never a
loop over keys or key blocks, so the model answers for any sequence length at once. Segments, visible keys and the
chunk rule come from ``vocab``; the counts are what ``forms/`` executes:

- ``executed``: the rectangles the segment recipe hands to the kernel (each
  query segment against its whole key prefix, masked keys included);
- ``visible``: the causal pairs within documents only (the floor of a causal
  fused kernel);
- ``blockwise``: what ``laga_blockwise`` computes per key block and run (runs
  are row blocks of the segments cut at document boundaries; rows before the
  block and keys outside the run's window are cut), and the keys it rebuilds
  (each row block rebuilds its runs' windows).

Documents (``Config.doc_lens``): a query sees only keys of its own document;
each segment's kernel call gets its key window (``vocab.keys.key_window``) and
trimming rebuilds ``vocab.keys.key_ranges``. Still O(segments + documents).
"""
from __future__ import annotations

from dataclasses import dataclass
import bisect
from typing import List, Optional, Tuple

from ...vocab import keys as vkeys, segments as vsegments
from ...vocab.blocks import join_adjacent, query_block_rows
from ...vocab.documents import doc_pieces
from ...vocab.keys import key_window
from ..runspec import RunSpec
from .config import Config


@dataclass(frozen=True)
class QuerySegment:
    """A run of queries with consecutive positions and the key window the kernel is given."""

    length: int        # queries
    start: int         # global position of the first query
    key_end: int       # end of the key window (position)
    key_start: int = 0  # start of the key window: 0, or with documents the start of the
                        # first query's document

    @property
    def keys(self) -> int:
        """Keys the kernel call is given: the window's length."""
        return self.key_end - self.key_start


def _vocab_segments(cfg: Config, rank: int) -> List[vsegments.Segment]:
    return vsegments.query_segments(cfg.seq_layout, cfg.cp_size, rank, cfg.local_len,
                                    cfg.heads_split, cfg.documents,
                                    ulysses_degree=cfg.ulysses_degree)


def query_segments(cfg: Config, rank: int) -> List[QuerySegment]:
    """The segments the kernel is called on at rank ``rank`` (ulysses: every rank's tokens),
    each with its key window (one kernel call per segment)."""
    out = []
    for seg in _vocab_segments(cfg, rank):
        lo, hi = key_window(seg, cfg.seq_len, cfg.causal, cfg.documents)
        _, length, first = seg
        out.append(QuerySegment(length, first, hi, lo))
    return out


def key_ranges(cfg: Config, rank: int) -> List[Tuple[int, int]]:
    """Position ranges of the keys this rank's queries see: what trimming rebuilds
    (without documents the one prefix [0, visible_keys))."""
    return vkeys.key_ranges(_vocab_segments(cfg, rank), cfg.seq_len, cfg.causal, cfg.documents)


def visible_keys(cfg: Config, rank: int) -> int:
    """How many keys some query of this rank sees: what trimming rebuilds."""
    return sum(hi - lo for lo, hi in key_ranges(cfg, rank))


def rebuilt_keys(cfg: Config, rank: int, spec: RunSpec) -> int:
    """Keys whose K/V LAGA rebuilds: the visible ones when trimmed, else all S."""
    return visible_keys(cfg, rank) if spec.trim_causal_prefix else cfg.seq_len


def block_keys(cfg: Config, rank: int, spec: RunSpec) -> int:
    """Keys of the largest block a recomputing LAGA rebuilds at once."""
    last = rebuilt_keys(cfg, rank, spec)
    return min(spec.kv_block_size, last) if spec.kv_block_size else last


@dataclass(frozen=True)
class Pairs:
    executed: int   # pairs the kernels compute (masked ones included)
    visible: int    # causal pairs within documents only


def largest_row_block(cfg: Config, rank: int, spec: RunSpec) -> int:
    """Rows of the largest row block the blockwise walk takes (``laga_blockwise.row_blocks``:
    adjacent segments joined, cut into blocks of ``vocab.blocks.query_block_rows(kv_block_size)``
    rows)."""
    size = query_block_rows(spec.kv_block_size)
    return max(min(size or n, n) for _, n, _ in join_adjacent(_vocab_segments(cfg, rank)))


def _row_families(cfg: Config, rank: int, spec: RunSpec):
    """The blockwise walk's runs (row blocks cut at document boundaries) as families
    ``(rows, first query position, count, step)``: ``count`` runs of ``rows`` queries,
    ``step`` positions apart, inside one document piece. Along a family every count the
    model takes is affine in the run's index (the runs' offsets against the key blocks
    repeat, ``step`` being a multiple of the block), so it sums in closed form."""
    size = query_block_rows(spec.kv_block_size)
    for seg in join_adjacent(_vocab_segments(cfg, rank)):
        for local, n, g in doc_pieces(seg, cfg.documents):
            if size is None:
                yield n, g, 1, 0
                continue
            head = min(n, -(local - seg.local_start) % size)  # rows up to the segment's next row block
            middle, tail = divmod(n - head, size)
            if head:
                yield head, g, 1, 0
            if middle:
                yield size, g + head, middle, size
            if tail:
                yield tail, g + head + middle * size, 1, 0


def _sum_runs(cfg: Config, rank: int, spec: RunSpec, per_run) -> int:
    """Sum of ``per_run(rows, start, lo, hi)`` (``[lo, hi)`` the run's key window) over the
    blockwise walk's runs: an affine family is its count times its mean."""
    total = 0
    for m, g, count, step in _row_families(cfg, rank, spec):
        ends = [per_run(m, p, *key_window((0, m, p), cfg.seq_len, cfg.causal, cfg.documents))
                for p in {g, g + (count - 1) * step}]
        total += count * sum(ends) // len(ends)
    return total


def blockwise_rebuilds(cfg: Config, rank: int, spec: RunSpec) -> int:
    """Keys the blockwise walk rebuilds in one pass: every row block rebuilds the keys its
    runs see (their windows, which follow one another), once."""
    return _sum_runs(cfg, rank, spec, lambda m, g, lo, hi: hi - lo)


def _runs(cfg: Config, rank: int):
    """(length, query start, window start, window end) of every run: the query segments
    cut at document boundaries."""
    documents = cfg.documents
    for seg in _vocab_segments(cfg, rank):
        for piece in doc_pieces(seg, documents):
            lo, hi = key_window(piece, cfg.seq_len, cfg.causal, documents)
            yield piece[1], piece[2], lo, hi


def attention_pairs(cfg: Config, rank: int, spec: RunSpec) -> Pairs:
    """(query, key) pairs of one head and one sequence at rank ``rank``.

    Executed: the segment kernels run each segment against its key window (one
    call); the blockwise path runs, per key block, the rectangle of each run with
    a visible pair. O(segments + documents) either way."""
    runs = list(_runs(cfg, rank))
    visible = sum(run_visible_pairs(n, g, lo, hi, cfg.causal) for n, g, lo, hi in runs)
    if spec.recompute_kv:
        executed = _blockwise_executed(cfg, rank, spec)
    else:
        executed = sum(q.length * q.keys for q in query_segments(cfg, rank))
    return Pairs(executed, visible)


def _blockwise_executed(cfg: Config, rank: int, spec: RunSpec) -> int:
    """Blocks tile the key index: positions when untrimmed, else the trimmed ranges laid
    end to end (a run's window lies inside one range, so it stays contiguous)."""
    if spec.trim_causal_prefix:
        ranges = key_ranges(cfg, rank)
        starts = [lo for lo, _ in ranges]
        before = [0]
        for lo, hi in ranges:
            before.append(before[-1] + hi - lo)
        last = before[-1]
    else:
        last = cfg.seq_len

    def pairs(n, g, lo, hi):
        base = 0
        if spec.trim_causal_prefix:
            i = bisect.bisect_right(starts, lo) - 1
            base = before[i] - ranges[i][0]
        return window_block_pairs(n, base + g, base + lo, base + hi, spec.kv_block_size, last,
                                  cfg.causal)
    return _sum_runs(cfg, rank, spec, pairs)


def run_visible_pairs(length: int, start: int, lo: int, hi: int, causal: bool) -> int:
    """Pairs a run's queries see in its window [lo, hi): causal, query p sees [lo, p]."""
    if not causal:
        return length * (hi - lo)
    return length * (start - lo) + length * (length + 1) // 2


def window_block_pairs(length: int, start: int, lo: int, hi: int, block: Optional[int], last: int,
                       causal: bool) -> int:
    """Pairs ``laga_blockwise`` computes for a run (queries [start, start+length), key
    window [lo, hi), in key-index space) over key blocks of ``block`` tiling [0, last).

    Non-causal every row meets every key of the window. Causal (hi = start+length):
    the blocks from position 0 on give :func:`blockwise_pairs`; those blocks' keys
    before ``lo`` meet no row (the window starts there), and each of them met all
    ``length`` rows, since keys before ``lo <= start`` lie in blocks at or before
    the one holding ``start``.
    """
    if not causal:
        return length * (hi - lo)
    return blockwise_pairs(length, start, block, last, True) - length * lo


def segment_visible_pairs(length: int, start: int, causal: bool, total: int) -> int:
    """Pairs a segment's queries see: causal, query p sees keys [0, p]; else all ``total``."""
    if not causal:
        return length * total
    return length * start + length * (length + 1) // 2


def blockwise_pairs(length: int, start: int, block: Optional[int], last: int, causal: bool) -> int:
    """Pairs ``laga_blockwise`` computes for queries [start, start+length) over key blocks
    [k0, min(k0+block, last)), k0 = 0, block, ...: per block, the queries at positions
    >= k0 (causal) times the block's keys before the segment's end.

    With T = start+length (<= last): blocks at or before ``start`` keep every query,
    so together give ``length`` x (keys up to the end of the block holding ``start``).
    A later full block j gives block x (T - j*block); the block holding T-1,
    (T - j*block)^2. Summed as an arithmetic series.
    """
    if not causal:
        return length * last
    block = block or last
    end = start + length
    first_after = start // block + 1          # blocks j < first_after start at or before `start`
    pairs = length * min(first_after * block, end)
    last_block = -(-end // block) - 1         # the block holding key end-1
    if last_block >= first_after:
        full = last_block - first_after       # blocks first_after .. last_block-1
        pairs += block * (full * end - block * ((first_after + last_block - 1) * full // 2))
        pairs += (end - last_block * block) ** 2
    return pairs

"""Which (query, key) pairs and keys a rank works on, in closed form.

Every count here is O(segments), never a loop over keys or key blocks, so the
model answers for any sequence length at once. Segments, visible keys and the
chunk rule come from ``vocab``; the counts are what ``forms/`` executes:

- ``executed``: the rectangles the segment recipe hands to the kernel (each
  query segment against its whole key prefix, masked keys included);
- ``visible``: the causal pairs only (the floor of a causal fused kernel);
- ``blockwise``: what ``laga_blockwise`` computes per key block (rows before
  the block and keys after the segment are cut).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from .. import vocab
from ..runspec import RunSpec
from .config import Config


@dataclass(frozen=True)
class QuerySegment:
    """A run of queries with consecutive positions and the keys [0, key_end) it is given."""

    length: int        # queries
    start: int         # global position of the first query
    key_end: int       # keys from position 0 the kernel is called with


def query_segments(cfg: Config, rank: int) -> List[QuerySegment]:
    """The segments the kernel is called on at rank ``rank`` (ulysses: every rank's tokens)."""
    segs = vocab.query_segments(cfg.seq_layout, cfg.cp_size, rank, cfg.local_len, cfg.heads_split,
                                  ulysses_degree=cfg.ulysses_degree)
    return [QuerySegment(seg[1], seg[2], vocab.key_prefix(seg, cfg.seq_len, cfg.causal))
            for seg in segs]


def visible_keys(cfg: Config, rank: int) -> int:
    """Keys [0, end) some query of this rank sees: what prefix trimming rebuilds."""
    segs = vocab.query_segments(cfg.seq_layout, cfg.cp_size, rank, cfg.local_len, cfg.heads_split,
                                  ulysses_degree=cfg.ulysses_degree)
    return vocab.visible_keys(segs, cfg.seq_len, cfg.causal)


def rebuilt_keys(cfg: Config, rank: int, spec: RunSpec) -> int:
    """Keys whose K/V LAGA rebuilds: the visible prefix when trimmed, else all S."""
    return visible_keys(cfg, rank) if spec.trim_causal_prefix else cfg.seq_len


def block_keys(cfg: Config, rank: int, spec: RunSpec) -> int:
    """Keys of the largest block a recomputing LAGA rebuilds at once."""
    last = rebuilt_keys(cfg, rank, spec)
    return min(spec.kv_block_size, last) if spec.kv_block_size else last


@dataclass(frozen=True)
class Pairs:
    executed: int   # pairs the kernels compute (masked ones included)
    visible: int    # causal pairs only


def attention_pairs(cfg: Config, rank: int, spec: RunSpec) -> Pairs:
    """(query, key) pairs of one head and one sequence at rank ``rank``."""
    segs = query_segments(cfg, rank)
    visible = sum(segment_visible_pairs(q.length, q.start, cfg.causal, cfg.seq_len) for q in segs)
    if spec.recompute_kv:
        last = rebuilt_keys(cfg, rank, spec)
        executed = sum(blockwise_pairs(q.length, q.start, spec.kv_block_size, last, cfg.causal)
                       for q in segs)
    else:
        executed = sum(q.length * q.key_end for q in segs)
    return Pairs(executed, visible)


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

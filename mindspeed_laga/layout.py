"""Which global sequence positions each CP rank holds.

- ``contiguous``: rank r holds ``[r*s, (r+1)*s)`` (MindSpeed ulysses).
- ``zigzag``: the sequence is cut into 2P chunks; rank r holds chunks r and
  2P-1-r, in that order (Megatron CP, MindSpeed megatron/kvallgather).
- ``doc_zigzag``: every document (``cu_seqlens``) is cut into 2P chunks; rank
  r holds chunks r and 2P-1-r of each document, documents in order
  (MindSpeed's megatron_cp split under --reset-attention-mask, Megatron/TE's
  THD split).
- hybrid CP (``ulysses_degree`` U > 1, rank = r*U + u): ``contiguous`` as
  above; ``zigzag`` cuts the sequence into 2R chunks (R = P/U), ring rank r
  takes chunks r and 2R-1-r, and Ulysses rank u the u-th of U contiguous
  pieces of that pair (MindSpeed's hybrid_cp_algo batch).

A *segment* is a run of local tokens with consecutive global positions:
``(local_start, length, global_start)``. Causal masks are always built from
segments, i.e. from true global positions, never from local indices.
"""
from __future__ import annotations

from typing import List

import torch

from .vocab.documents import resolve_documents
from .vocab.segments import Documents, check_seq_len, rank_segments

# The chunk rule and segments are shared vocabulary (vocab/segments.py); this module
# adds the torch side: position tensors, reordering, sharding.


def positions(layout: str, cp_size: int, rank: int, local_len: int,
              documents: Documents = None, *, ulysses_degree: int = 1) -> torch.Tensor:
    """Global position of each local token, shape [local_len]."""
    parts = [torch.arange(g, g + n) for _, n, g in
             rank_segments(layout, cp_size, rank, local_len, documents, ulysses_degree=ulysses_degree)]
    return torch.cat(parts)


def gathered_positions(layout: str, cp_size: int, local_len: int,
                       documents: Documents = None, *, ulysses_degree: int = 1) -> torch.Tensor:
    """Global positions of a rank-order all-gather of every rank's tokens."""
    return torch.cat([positions(layout, cp_size, r, local_len, documents,
                                ulysses_degree=ulysses_degree) for r in range(cp_size)])


def to_position_order(layout: str, cp_size: int, local_len: int,
                      documents: Documents = None, *, ulysses_degree: int = 1) -> torch.Tensor:
    """Index ``idx`` with ``gathered[idx]`` in global position order.

    Identity for ``contiguous``; a permutation of chunks for ``zigzag`` and
    ``doc_zigzag``.
    """
    return torch.argsort(gathered_positions(layout, cp_size, local_len, documents,
                                            ulysses_degree=ulysses_degree))


def is_identity(layout: str, cp_size: int) -> bool:
    return cp_size == 1 or layout == "contiguous"


def shard(full: torch.Tensor, layout: str, cp_size: int, rank: int, dim: int = 0,
          cu_seqlens=None, *, ulysses_degree: int = 1) -> torch.Tensor:
    """Rank ``rank``'s part of a full-sequence tensor (for tests, data loaders, the CLI).

    ``cu_seqlens``: the document boundaries, needed by ``doc_zigzag``.
    ``ulysses_degree``: hybrid CP's U (1: not hybrid).
    """
    documents = _documents(cu_seqlens, full.shape[dim], layout, cp_size, ulysses_degree)
    local_len = full.shape[dim] // cp_size
    idx = positions(layout, cp_size, rank, local_len, documents,
                    ulysses_degree=ulysses_degree).to(full.device)
    return full.index_select(dim, idx)


def unshard(parts: List[torch.Tensor], layout: str, dim: int = 0, cu_seqlens=None, *,
            ulysses_degree: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard`: every rank's part, in rank order -> full sequence."""
    cp_size = len(parts)
    local_len = parts[0].shape[dim]
    documents = _documents(cu_seqlens, local_len * cp_size, layout, cp_size, ulysses_degree)
    gathered = torch.cat(parts, dim=dim)
    idx = to_position_order(layout, cp_size, local_len, documents,
                            ulysses_degree=ulysses_degree).to(gathered.device)
    return gathered.index_select(dim, idx)


def _documents(cu_seqlens, seq_len: int, layout: str, cp_size: int,
               ulysses_degree: int = 1) -> Documents:
    """The checked boundaries (or None); the sequence must cut into the layout's chunks."""
    if layout != "doc_zigzag":
        check_seq_len(seq_len, layout, cp_size, ulysses_degree=ulysses_degree)
    if isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = cu_seqlens.tolist()
    return resolve_documents(cu_seqlens, seq_len, layout, cp_size, ulysses_degree)

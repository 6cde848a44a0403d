"""Which global sequence positions each CP rank holds.

- ``contiguous``: rank r holds ``[r*s, (r+1)*s)`` (MindSpeed ulysses).
- ``zigzag``: the sequence is cut into 2P chunks; rank r holds chunks r and
  2P-1-r, in that order (Megatron CP, MindSpeed megatron/kvallgather).
- ``doc_zigzag``: every document (``cu_seqlens``) is cut into 2P chunks; rank
  r holds chunks r and 2P-1-r of each document, documents in order
  (MindSpeed's megatron_cp split under --reset-attention-mask, Megatron/TE's
  THD split).

A *segment* is a run of local tokens with consecutive global positions:
``(local_start, length, global_start)``. Causal masks are always built from
segments, i.e. from true global positions, never from local indices.
"""
from __future__ import annotations

from typing import List

import torch

from .vocab import (LAYOUTS, Documents, Segment, check_documents, check_seq_len,  # noqa: F401
                    num_chunks, rank_segments)

# The chunk rule and segments are shared vocabulary (vocab.py); this module adds
# the torch side: position tensors, reordering, sharding.
segments = rank_segments


def positions(layout: str, cp_size: int, rank: int, local_len: int,
              documents: Documents = None) -> torch.Tensor:
    """Global position of each local token, shape [local_len]."""
    parts = [torch.arange(g, g + n)
             for _, n, g in segments(layout, cp_size, rank, local_len, documents)]
    return torch.cat(parts)


def gathered_positions(layout: str, cp_size: int, local_len: int,
                       documents: Documents = None) -> torch.Tensor:
    """Global positions of a rank-order all-gather of every rank's tokens."""
    return torch.cat([positions(layout, cp_size, r, local_len, documents) for r in range(cp_size)])


def to_position_order(layout: str, cp_size: int, local_len: int,
                      documents: Documents = None) -> torch.Tensor:
    """Index ``idx`` with ``gathered[idx]`` in global position order.

    Identity for ``contiguous``; a permutation of chunks for ``zigzag`` and
    ``doc_zigzag``.
    """
    return torch.argsort(gathered_positions(layout, cp_size, local_len, documents))


def is_identity(layout: str, cp_size: int) -> bool:
    return cp_size == 1 or layout == "contiguous"


def shard(full: torch.Tensor, layout: str, cp_size: int, rank: int, dim: int = 0,
          cu_seqlens=None) -> torch.Tensor:
    """Rank ``rank``'s part of a full-sequence tensor (for tests, data loaders, the CLI).

    ``cu_seqlens``: the document boundaries, needed by ``doc_zigzag``.
    """
    documents = _documents(cu_seqlens, full.shape[dim], layout, cp_size)
    local_len = full.shape[dim] // cp_size
    idx = positions(layout, cp_size, rank, local_len, documents).to(full.device)
    return full.index_select(dim, idx)


def unshard(parts: List[torch.Tensor], layout: str, dim: int = 0, cu_seqlens=None) -> torch.Tensor:
    """Inverse of :func:`shard`: every rank's part, in rank order -> full sequence."""
    cp_size = len(parts)
    local_len = parts[0].shape[dim]
    documents = _documents(cu_seqlens, local_len * cp_size, layout, cp_size)
    gathered = torch.cat(parts, dim=dim)
    idx = to_position_order(layout, cp_size, local_len, documents).to(gathered.device)
    return gathered.index_select(dim, idx)


def _documents(cu_seqlens, seq_len: int, layout: str, cp_size: int) -> Documents:
    if cu_seqlens is None:
        if layout == "doc_zigzag":
            raise ValueError("layout='doc_zigzag' needs cu_seqlens= (the document boundaries)")
        check_seq_len(seq_len, layout, cp_size)
        return None
    if layout != "doc_zigzag":
        check_seq_len(seq_len, layout, cp_size)
    return check_documents(cu_seqlens, seq_len, layout, cp_size)

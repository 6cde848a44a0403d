"""Which global sequence positions each CP rank holds.

- ``contiguous``: rank r holds ``[r*s, (r+1)*s)`` (MindSpeed ulysses).
- ``zigzag``: the sequence is cut into 2P chunks; rank r holds chunks r and
  2P-1-r, in that order (Megatron CP, MindSpeed megatron/kvallgather).

A *segment* is a run of local tokens with consecutive global positions:
``(local_start, length, global_start)``. Causal masks are always built from
segments, i.e. from true global positions, never from local indices.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

LAYOUTS = ("zigzag", "contiguous")
Segment = Tuple[int, int, int]  # (local_start, length, global_start)


def num_chunks(layout: str, cp_size: int) -> int:
    """How many equal pieces the full sequence is cut into."""
    return 2 * cp_size if layout == "zigzag" else cp_size


def check_seq_len(seq_len: int, layout: str, cp_size: int) -> None:
    """The full sequence must cut into equal chunks: 2P (zigzag) or P (contiguous)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; use one of {LAYOUTS}")
    chunks = num_chunks(layout, cp_size)
    if seq_len % chunks:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {chunks} "
            f"({'2*CP' if layout == 'zigzag' else 'CP'} for layout={layout!r}, CP={cp_size}); "
            f"pad it to a multiple of {chunks}")


def segments(layout: str, cp_size: int, rank: int, local_len: int) -> List[Segment]:
    """The consecutive-position runs of rank ``rank``'s local tokens."""
    if cp_size == 1:
        return [(0, local_len, 0)]
    if layout == "contiguous":
        return [(0, local_len, rank * local_len)]
    c = local_len // 2
    return [(0, c, rank * c), (c, c, (2 * cp_size - 1 - rank) * c)]


def positions(layout: str, cp_size: int, rank: int, local_len: int) -> torch.Tensor:
    """Global position of each local token, shape [local_len]."""
    parts = [torch.arange(g, g + n) for _, n, g in segments(layout, cp_size, rank, local_len)]
    return torch.cat(parts)


def gathered_positions(layout: str, cp_size: int, local_len: int) -> torch.Tensor:
    """Global positions of a rank-order all-gather of every rank's tokens."""
    return torch.cat([positions(layout, cp_size, r, local_len) for r in range(cp_size)])


def to_position_order(layout: str, cp_size: int, local_len: int) -> torch.Tensor:
    """Index ``idx`` with ``gathered[idx]`` in global position order.

    Identity for ``contiguous``; a permutation of chunks for ``zigzag``.
    """
    return torch.argsort(gathered_positions(layout, cp_size, local_len))


def is_identity(layout: str, cp_size: int) -> bool:
    return cp_size == 1 or layout == "contiguous"


def shard(full: torch.Tensor, layout: str, cp_size: int, rank: int, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s part of a full-sequence tensor (for tests, data loaders, the CLI)."""
    check_seq_len(full.shape[dim], layout, cp_size)
    local_len = full.shape[dim] // cp_size
    idx = positions(layout, cp_size, rank, local_len).to(full.device)
    return full.index_select(dim, idx)


def unshard(parts: List[torch.Tensor], layout: str, dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`shard`: every rank's part, in rank order -> full sequence."""
    cp_size = len(parts)
    local_len = parts[0].shape[dim]
    gathered = torch.cat(parts, dim=dim)
    idx = to_position_order(layout, cp_size, local_len).to(gathered.device)
    return gathered.index_select(dim, idx)

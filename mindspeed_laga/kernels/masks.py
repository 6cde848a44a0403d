"""The one dense visibility mask, for the kernels that take one (eager, sdpa, eager blocks).

Causal visibility everywhere in the kernels is one number, the causal
``offset``: key ``j`` is visible to query row ``i`` iff ``j <= i + offset``
(rows and keys counted from 0 in the tensors handed over). A query segment
that ends at the end of its key prefix is bottom-right aligned:
``offset = keys - rows``. ``None`` means every key is visible.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch


def bottom_right(rows: int, keys: int) -> int:
    """The causal offset of rows whose last row sees the last key."""
    return keys - rows


def keep_mask(rows: int, keys: int, offset: Optional[int], device) -> Optional[torch.Tensor]:
    """[rows, keys] bool, True = visible (key j for row i iff j <= i + offset); None = all."""
    if offset is None:
        return None
    return torch.ones(rows, keys, dtype=torch.bool, device=device).tril(diagonal=offset)


class Piece(NamedTuple):
    """A document piece of a query segment, relative to the segment's queries and its
    key window: its query rows ``[q_start, q_start + length)`` see keys ``[k_start, k_end)``."""
    q_start: int
    length: int
    k_start: int
    k_end: int


def pieces_keep_mask(pieces: Sequence[Piece], q_len: int, k_len: int, causal: bool,
                     device) -> torch.Tensor:
    """[q_len, k_len] bool, True = visible: each piece's rows see its key range,
    causal pieces bottom-right aligned (the piece's last row sees its last key)."""
    keep = torch.zeros(q_len, k_len, dtype=torch.bool, device=device)
    for q0, n, k0, k1 in pieces:
        block = keep[q0:q0 + n, k0:k1]
        block.fill_(True)
        if causal:
            block.copy_(keep_mask(n, k1 - k0, bottom_right(n, k1 - k0), device))
    return keep


def segment_keep(rows: int, keys: int, causal: bool, pieces, device,
                 keep: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The visibility of a query segment's rows over its key window, chosen once for every
    kernel: ``keep`` when given (key padding, :func:`padded_keep_mask`), else its document
    pieces, else the causal mask bottom-right aligned; None = every key visible."""
    if keep is not None:
        return keep
    if pieces is not None:
        return pieces_keep_mask(pieces, rows, keys, causal, device)
    if causal:
        return keep_mask(rows, keys, bottom_right(rows, keys), device)
    return None


def block_keep(rows: int, keys: int, offset: Optional[int], pad, device):
    """The visibility a block kernel applies: the causal offset's [rows, keys] mask (None:
    all visible), and with key padding (``pad`` [b, keys], True = padding) that mask minus
    the padding keys, [b, 1, rows, keys] (or [b, 1, 1, keys] when the offset is None)."""
    keep = keep_mask(rows, keys, offset, device)
    if pad is None:
        return keep
    return (~pad[:, None, None, :]) if keep is None else keep & ~pad[:, None, None, :]


def padded_keep_mask(rows: int, key_pad: torch.Tensor, causal: bool, pieces=None):
    """([b, 1, rows, W] bool, True = visible; [b, 1, rows, 1] bool, True = the row sees no key).

    ``key_pad`` [b, W]: True = padding key, for the W keys of the segment's window.
    Visibility is the segment's own (causal bottom-right aligned, or its document
    pieces) minus the padding keys. A row that sees no key is handed to the kernel
    with its whole window visible (so no kernel meets a fully masked row, whose
    output fused ops leave unspecified); the caller overwrites its output.
    """
    keys, device = key_pad.shape[-1], key_pad.device
    base = segment_keep(rows, keys, causal, pieces, device)
    if base is None:
        base = torch.ones(rows, keys, dtype=torch.bool, device=device)
    keep = base & ~key_pad[:, None, None, :]
    empty = ~keep.any(dim=-1, keepdim=True)
    return keep | empty, empty

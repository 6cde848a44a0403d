"""Dense causal masks for the kernels that take one (eager, sdpa)."""
from __future__ import annotations

from typing import Sequence, Tuple

import torch


def causal_keep_mask(q_len: int, k_len: int, device) -> torch.Tensor:
    """[q_len, k_len] bool, True = visible: bottom-right-aligned causal."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)


# A document piece of a query segment: (query start, query length, key start, key end),
# relative to the segment's queries and its key window.
Piece = Tuple[int, int, int, int]


def pieces_keep_mask(pieces: Sequence[Piece], q_len: int, k_len: int, causal: bool,
                     device) -> torch.Tensor:
    """[q_len, k_len] bool, True = visible: each piece's rows see its key range,
    causal pieces bottom-right aligned (the piece's last row sees its last key)."""
    keep = torch.zeros(q_len, k_len, dtype=torch.bool, device=device)
    for q0, n, k0, k1 in pieces:
        block = keep[q0:q0 + n, k0:k1]
        block.fill_(True)
        if causal:
            block.copy_(causal_keep_mask(n, k1 - k0, device))
    return keep

"""Key/value heads shared by every backend (MLA's rebuilt K/V may carry fewer heads than
the queries: one latent head broadcast to all)."""
from __future__ import annotations

import torch


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Broadcast [b, n_k, S, d] to [b, heads, S, d] (a view; no copy)."""
    return x if x.shape[1] == heads else x.expand(x.shape[0], heads, *x.shape[2:])

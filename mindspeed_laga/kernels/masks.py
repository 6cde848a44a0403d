"""Dense causal masks for the kernels that take one (eager, sdpa)."""
from __future__ import annotations

import torch


def causal_keep_mask(q_len: int, k_len: int, device) -> torch.Tensor:
    """[q_len, k_len] bool, True = visible: bottom-right-aligned causal."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)

"""Eager attention: the score matrix is materialized (and kept for backward).

Scores and softmax run in float32 for half-precision inputs, as fused kernels
accumulate in float32; the probabilities are cast back before ``@ v``.
"""
from __future__ import annotations

import torch

from .masks import bottom_right, keep_mask, pieces_keep_mask
from .precision import acc_dtype


def expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Broadcast [b, n_k, S, d] to [b, heads, S, d] (a view; no copy)."""
    return x if x.shape[1] == heads else x.expand(x.shape[0], heads, *x.shape[2:])


def attend_segment(q, k, v, *, scale: float, causal: bool, pieces=None, keep=None):
    """``keep`` [b, 1, s_q, W] bool (key padding, ``masks.padded_keep_mask``): the
    visibility of every row, replacing ``causal`` and ``pieces``."""
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    compute = acc_dtype(q.dtype)
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-1, -2)) * scale
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    elif pieces is not None:
        keep = pieces_keep_mask(pieces, q.shape[2], k.shape[2], causal, q.device)
        scores = scores.masked_fill(~keep, float("-inf"))
    elif causal:
        keep = keep_mask(q.shape[2], k.shape[2], bottom_right(q.shape[2], k.shape[2]), q.device)
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v)

"""torch.nn.functional.scaled_dot_product_attention (flash / memory-efficient / math)."""
from __future__ import annotations

import torch.nn.functional as F

from .eager import expand_kv
from .masks import causal_keep_mask, pieces_keep_mask


def attend_segment(q, k, v, *, scale: float, causal: bool, pieces=None):
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    mask = None
    if pieces is not None:
        mask = pieces_keep_mask(pieces, q.shape[2], k.shape[2], causal, q.device)
    elif causal and q.shape[2] != k.shape[2]:
        # SDPA's is_causal is top-left aligned; a query segment ending at the
        # prefix end needs the bottom-right alignment.
        mask = causal_keep_mask(q.shape[2], k.shape[2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                          is_causal=causal and mask is None, scale=scale)

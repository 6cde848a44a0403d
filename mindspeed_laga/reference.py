"""Single-device reference: causal MLA attention over the full sequence.

Written from the definition, independent of the forms: every multi-rank
result is compared with this (run in float64 on the unsharded inputs).
"""
from __future__ import annotations

import torch


def mla_attention_reference(query, kv_latent, k_pos_emb, kv_up_weight, *, softmax_scale,
                            causal=True):
    """query [S, b, n, d_n+d_r], kv_latent [S, b, d_c], k_pos_emb [S, b, d_r] -> [S, b, n*d_v]."""
    S, b, n, _ = query.shape
    d_r = k_pos_emb.shape[-1]
    d_n = query.shape[-1] - d_r
    d_v = kv_up_weight.shape[0] // n - d_n
    w = kv_up_weight.view(n, d_n + d_v, -1)
    k_nope = torch.einsum("sbc,ndc->sbnd", kv_latent, w[:, :d_n])
    value = torch.einsum("sbc,nvc->sbnv", kv_latent, w[:, d_n:])
    key = torch.cat([k_nope, k_pos_emb[:, :, None].expand(S, b, n, d_r)], dim=-1)
    scores = torch.einsum("qbnd,kbnd->bnqk", query, key) * softmax_scale
    if causal:
        future = torch.ones(S, S, dtype=torch.bool, device=query.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.einsum("bnqk,kbnv->qbnv", probs, value)
    return out.reshape(S, b, n * d_v)

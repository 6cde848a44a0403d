"""LAGA for sparse MLA (DSA: DeepSeek-V3.2, GLM-5): one gather per layer.

DSA's attention is absorbed MQA over the latent: every head of a query attends the
same selected keys, each key being ``[kv_latent | k_pos_emb]`` (W_UK folded into the
query, W_UV into the output). The indexer that selects them needs one more per-key
tensor, its index key. So a rank needs, of every other rank's tokens, exactly
``[kv_latent | k_pos_emb | index_key]`` (512 + 64 + 128 = 704 values per token at
DeepSeek-V3.2's dims), and one all-gather of that concatenation serves the indexer's
scores and top-k, the sparse attention and the indexer's KL loss; its backward is one
reduce-scatter. Queries, the index queries and the index weights stay local.

The attention runs over the picked keys only (gathered per query), in the inputs'
dtype; the indexer as ``sparse_index`` describes it.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import comm, layout as layouts
from .sparse_index import index_scores, indexer_loss, top_k

LAYOUTS = ("contiguous", "zigzag")


class SparseResult(NamedTuple):
    output: torch.Tensor                  # [s, b, n*v_head_dim], the input of linear_proj
    topk_indices: torch.Tensor            # [b, s, k] global key positions, -1: no key
    indexer_loss: Optional[torch.Tensor]  # scalar (this rank's mean), or None


def sparse_laga_attention(query, kv_latent, k_pos_emb, kv_up_weight, index_query, index_key,
                          index_weights, *, index_topk: int, softmax_scale: float,
                          qk_head_dim: int, v_head_dim: int, cp_group=None,
                          layout: str = "zigzag", indexer_loss_coeff: Optional[float] = None
                          ) -> SparseResult:
    """Sparse MLA of this rank's queries over the whole sequence, one gather per call.

    Local tensors (s = this rank's tokens, rope applied at their global positions):
    ``query`` [s, b, n, qk_head_dim + d_r], ``kv_latent`` [s, b, d_c], ``k_pos_emb``
    [s, b, d_r], ``kv_up_weight`` [n*(qk_head_dim + v_head_dim), d_c], ``index_query``
    [s, b, H, D], ``index_key`` [s, b, D], ``index_weights`` [s, b, H] (scales applied).
    ``layout``: how the sequence is split over ``cp_group`` ("contiguous" or "zigzag").
    ``indexer_loss_coeff``: None, no loss; else the KL loss times it, this rank's mean
    over its queries (the attention probabilities it reads pass no gradient).
    """
    _check(query, kv_latent, k_pos_emb, kv_up_weight, index_query, index_key, index_weights,
           index_topk, qk_head_dim, v_head_dim, layout)
    size, rank, s = comm.check_group(cp_group), comm.group_rank(cp_group), query.shape[0]
    latent, k_pe, keys = _gather_keys(kv_latent, k_pos_emb, index_key, cp_group, layout)
    query_pos = layouts.positions(layout, size, rank, s).to(query.device)
    key_pos = torch.arange(size * s, device=query.device)
    picks = top_k(index_scores(index_query, keys, index_weights, query_pos, key_pos),
                  index_topk, query_pos)
    valid = picks.indices >= 0
    probs, output = _attend(query, latent, k_pe, kv_up_weight, picks.indices, valid,
                            softmax_scale, qk_head_dim, v_head_dim)
    loss = None
    if indexer_loss_coeff is not None:
        loss = indexer_loss(probs.detach(), picks.scores, valid, indexer_loss_coeff)
    return SparseResult(output, picks.indices, loss)


def _gather_keys(kv_latent, k_pos_emb, index_key, cp_group, layout):
    """Every position's (kv_latent, k_pos_emb, index_key), [S, b, *] in position order."""
    widths = [kv_latent.shape[-1], k_pos_emb.shape[-1], index_key.shape[-1]]
    packed = torch.cat([kv_latent, k_pos_emb, index_key], dim=-1)
    gathered = comm.gather_seq(packed, cp_group, tag="sparse_latent")
    size = comm.group_size(cp_group)
    if not layouts.is_identity(layout, size):
        order = layouts.to_position_order(layout, size, kv_latent.shape[0])
        gathered = gathered.index_select(0, order.to(gathered.device))
    return torch.split(gathered, widths, dim=-1)


def _attend(query, latent, k_pe, kv_up_weight, indices, valid, softmax_scale, qk_head_dim,
            v_head_dim):
    """(probabilities [b, n, s, k], output [s, b, n*d_v]): absorbed attention of each
    query over its picked keys."""
    s, b, n, _ = query.shape
    weight = kv_up_weight.view(n, qk_head_dim + v_head_dim, -1)
    w_uk, w_uv = weight[:, :qk_head_dim], weight[:, qk_head_dim:]
    q_nope, q_pe = torch.split(query, [qk_head_dim, query.shape[-1] - qk_head_dim], dim=-1)
    q_latent = torch.einsum("sbnd,ndc->bnsc", q_nope, w_uk)
    batch = torch.arange(b, device=query.device).view(b, 1, 1)
    picked = indices.clamp(min=0)
    latent_sel = latent.transpose(0, 1)[batch, picked]  # [b, s, k, d_c]
    k_pe_sel = k_pe.transpose(0, 1)[batch, picked]      # [b, s, k, d_r]
    scores = (torch.einsum("bnsc,bskc->bnsk", q_latent, latent_sel)
              + torch.einsum("sbnr,bskr->bnsk", q_pe, k_pe_sel)) * softmax_scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out_latent = torch.einsum("bnsk,bskc->sbnc", probs, latent_sel)
    output = torch.einsum("sbnc,nvc->sbnv", out_latent, w_uv)
    return probs, output.reshape(s, b, n * v_head_dim)


def _check(query, kv_latent, k_pos_emb, kv_up_weight, index_query, index_key, index_weights,
           index_topk, qk_head_dim, v_head_dim, layout):
    """Shape and option errors, each naming the argument (the same on every rank, so every
    rank raises before the gather)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} for sparse MLA, got {layout!r}")
    if not isinstance(index_topk, int) or index_topk < 1:
        raise ValueError(f"index_topk must be a positive int, got {index_topk!r}")
    s, b, n, d_q = query.shape
    d_c, d_r = kv_latent.shape[-1], k_pos_emb.shape[-1]
    expect = {"kv_latent": (kv_latent, (s, b, d_c)), "k_pos_emb": (k_pos_emb, (s, b, d_r)),
              "index_key": (index_key, (s, b, index_key.shape[-1])),
              "index_query": (index_query, (s, b, index_query.shape[2], index_key.shape[-1])),
              "index_weights": (index_weights, (s, b, index_query.shape[2])),
              "kv_up_weight": (kv_up_weight, (n * (qk_head_dim + v_head_dim), d_c))}
    for name, (tensor, shape) in expect.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} (query {list(query.shape)}), "
                             f"got {list(tensor.shape)}")
    if d_q != qk_head_dim + d_r:
        raise ValueError(f"query's last dim {d_q} must be qk_head_dim {qk_head_dim} + "
                         f"k_pos_emb's {d_r}")
    dtypes = {t.dtype for t in (kv_latent, k_pos_emb, index_key)}
    if len(dtypes) != 1:
        raise ValueError("kv_latent, k_pos_emb and index_key travel in one gather and must "
                         f"share a dtype, got {kv_latent.dtype}, {k_pos_emb.dtype}, "
                         f"{index_key.dtype}")

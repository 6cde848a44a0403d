"""The indexer's top-k with a backward that keeps nothing of size S_local x S.

Autograd through :func:`~mindspeed_laga.sparse.indexer.index_scores` and
:func:`~mindspeed_laga.sparse.indexer.top_k` keeps, from forward to backward, the float32
relu logits ``[b, H, s, S]`` (for the weights' and the keys' grads), the causal mask
``[s, S]`` and, through the ``[b, s, k]`` view of the picks, the whole ``[b, s, S]``
sort result. The loss's gradient reaches the scores at the k picks only, so
:class:`IndexerTopK` runs the same forward without a graph and keeps the index inputs
and the ``[b, s, k]`` picks; its backward recomputes the products at the picks (the
same float32 products, the same relu, the same weighting) and scatters the keys' grads
back to their positions. The grads are those of the autograd path up to the order of
the sums (float32 products: about 1e-7 relative).
"""
from __future__ import annotations

import torch

from .indexer import TopK, index_scores, top_k


def indexer_topk(index_query, index_key, index_weights, query_pos, index_topk: int,
                 query_start=None) -> TopK:
    """:func:`top_k` of :func:`index_scores` (keys at positions 0 ... S-1; ``query_start``:
    each query's document start, or None), the scores at the picks carrying the indexer
    inputs' gradient (module docstring)."""
    scores, indices = IndexerTopK.apply(index_query, index_key, index_weights, query_pos,
                                        index_topk, query_start)
    return TopK(indices, scores)


class IndexerTopK(torch.autograd.Function):
    """(picked scores [b, s, k], picks [b, s, k]) of index_query [s, b, H, D], index_key
    [S, b, D] (position order), index_weights [s, b, H]."""

    @staticmethod
    def forward(ctx, index_query, index_key, index_weights, query_pos, index_topk,
                query_start=None):
        key_pos = torch.arange(index_key.shape[0], device=index_key.device)
        scores = index_scores(index_query, index_key, index_weights, query_pos, key_pos,
                              query_start)
        picks = top_k(scores, index_topk, query_pos, query_start)
        ctx.save_for_backward(index_query, index_key, index_weights, picks.indices)
        ctx.mark_non_differentiable(picks.indices)
        return picks.scores, picks.indices

    @staticmethod
    def backward(ctx, grad_scores, _grad_indices):
        index_query, index_key, index_weights, indices = ctx.saved_tensors
        grads = _picked_grads(grad_scores, index_query, index_key, index_weights, indices)
        return (*grads, None, None, None)


def _picked_grads(grad_scores, index_query, index_key, index_weights, indices):
    """The index inputs' grads from the scores' grad at the picks: the backward of
    ``sum_h relu(q_h . k) * w_h`` (float32 products) at the picked keys only; a pick of
    -1 (a future key or another document's, masked to -inf) passes none."""
    valid = indices >= 0
    b = indices.shape[0]
    batch = torch.arange(b, device=indices.device).view(b, 1, 1)
    picked = indices.clamp(min=0)
    q = index_query.permute(1, 2, 0, 3).to(torch.float32)                  # [b, H, s, D]
    keys = index_key.transpose(0, 1).to(torch.float32)[batch, picked]       # [b, s, k, D]
    products = torch.einsum("bhsd,bskd->bhsk", q, keys)                    # [b, H, s, k]
    weights = index_weights.permute(1, 2, 0).unsqueeze(-1)                 # [b, H, s, 1]
    grad = torch.where(valid, grad_scores, torch.zeros_like(grad_scores)).unsqueeze(1)
    grad_weights = (grad * torch.relu(products)).sum(dim=-1)               # [b, H, s]
    grad_products = (grad * weights).to(torch.float32) * (products > 0)
    grad_q = torch.einsum("bhsk,bskd->bhsd", grad_products, keys)
    grad_keys = torch.einsum("bhsk,bhsd->bskd", grad_products, q)
    grad_key = torch.zeros(b, index_key.shape[0], index_key.shape[-1], dtype=torch.float32,
                           device=index_key.device)
    grad_key.index_put_((batch.expand_as(picked), picked), grad_keys, accumulate=True)
    return (grad_q.permute(2, 0, 1, 3).to(index_query.dtype),
            grad_key.transpose(0, 1).to(index_key.dtype),
            grad_weights.permute(2, 0, 1).to(index_weights.dtype))

"""The lightning indexer of sparse MLA (DSA): scores, top-k, and its KL loss.

Everything here works on this rank's queries against every key of the sequence,
in global position order, so a query row sees the same numbers at any CP size.

- scores: ``sum_h relu(q_h . k) * w_h`` with the product in float32 (what the host's
  bf16 path does whatever the input dtype), causal by global position; with packed
  documents also blind to keys before the query's document start (``query_start``).
- top-k: the ``k = min(index_topk, S)`` best keys per query, ordered by score and,
  between equal scores, by position (lowest first), so ties resolve the same way on
  every rank and CP size; picks after the query's own position (or before its
  document's start) are -1.
- loss: KL(attention || indexer), the paper's direction: the attention's probabilities
  at the picks (summed over heads and L1-normalized, the target) against the indexer's
  softmax over its picks, ``sum target * (log target - log indexer)`` per query row,
  mean over this rank's rows (each CP rank's mean, as the host's own CP keeps it;
  Megatron averages grads over CP, which makes it the CP 1 loss).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

# added to both distributions in the KL loss, as the DSA reference does
KL_EPS = 1e-8


class TopK(NamedTuple):
    indices: torch.Tensor  # [b, s, k] int64 global key positions, -1: no key
    scores: torch.Tensor   # [b, s, k] the indexer's scores at the picks (-inf at -1)


def index_scores(index_query, index_key, index_weights, query_pos, key_pos, query_start=None):
    """[b, s, S] causal indexer scores.

    index_query [s, b, H, D], index_key [S, b, D] (position order), index_weights
    [s, b, H]; ``query_pos`` [s] / ``key_pos`` [S] the global positions; ``query_start``
    [s] (or None) each query's document start: keys before it are masked too."""
    q = index_query.permute(1, 2, 0, 3).to(torch.float32)         # [b, H, s, D]
    k = index_key.permute(1, 2, 0).unsqueeze(1).to(torch.float32)  # [b, 1, D, S]
    logits = torch.relu(torch.matmul(q, k))                        # [b, H, s, S]
    scores = (logits * index_weights.permute(1, 2, 0).unsqueeze(-1)).sum(dim=1)
    unseen = key_pos.view(1, 1, -1) > query_pos.view(1, -1, 1)
    if query_start is not None:  # another document's keys
        unseen = unseen | (key_pos.view(1, 1, -1) < query_start.view(1, -1, 1))
    return scores.masked_fill(unseen, float("-inf"))


def top_k(scores, index_topk: int, query_pos, query_start=None) -> TopK:
    """The deterministic top-k of :func:`index_scores` over keys in position order
    (module docstring)."""
    count = min(index_topk, scores.shape[-1])
    # a stable sort keeps equal scores in position order: the lowest position wins a tie
    order = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices[..., :count]
    picked = torch.gather(scores, -1, order)
    seen = order <= query_pos.view(1, -1, 1)
    if query_start is not None:  # a short document leaves slots that picked masked keys
        seen = seen & (order >= query_start.view(1, -1, 1))
    positions = torch.where(seen, order, torch.full_like(order, -1))
    return TopK(positions, picked)


def attention_target(attn_probs):
    """[b, s, k] float32: the attention's probabilities at the picks (attn_probs
    [b, n, s, k], no gradient wanted through them) summed over heads, the loss's target
    before normalization (a sum over more heads adds these of every rank holding some)."""
    return attn_probs.to(torch.float32).sum(dim=1)


def indexer_loss(target, topk_scores, valid, coeff: float):
    """KL(attention || indexer) (module docstring): ``F.kl_div(log q, p)`` is
    ``sum p * (log p - log q)`` with p the attention's target and q the indexer's softmax.

    target [b, s, k]: :func:`attention_target`; topk_scores [b, s, k]; valid [b, s, k]
    bool."""
    target = torch.where(valid, target, torch.zeros_like(target))
    target = F.normalize(target, p=1, dim=-1)
    predicted = F.softmax(topk_scores, dim=-1, dtype=torch.float32)
    kl = F.kl_div((predicted + KL_EPS).log(), target + KL_EPS, reduction="none")
    return kl.sum(dim=-1).mean() * coeff

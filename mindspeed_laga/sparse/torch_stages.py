"""The sparse MLA (DSA) stages in plain torch: any device, any float dtype.

- indexer: ``sparse/indexer.py``'s scores and deterministic top-k over every
  gathered key (causal by global position, within the query's document when the call
  has documents), through ``sparse/topk_scores.py``, whose
  backward keeps nothing of size S_local x S;
- attention: absorbed MQA of each query over its picked keys, gathered per query
  (``[b, s, k, d_c + d_r]`` held), in the inputs' dtype;
- loss: the KL loss of ``sparse/indexer.py`` against the attention's probabilities
  at the picks, summed over this rank's heads, or over the heads of ``tp_group`` (an
  all-reduce of the detached head sums: the target carries no gradient); it also takes
  the ``all_keys`` target (:meth:`SparseTorch.loss_all_keys`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .absorbed import absorbed_scores, all_keys_probs, picked_output, softmax_stats
from .indexer import KL_EPS, attention_target, indexer_loss
from .stage import Attended, LossReads, SparseKernel
from .topk_scores import indexer_topk


class SparseTorch(SparseKernel):
    name = "torch"
    loss_reads = LossReads.PROBS
    supports_all_keys = True
    kl_eps = KL_EPS  # as the DSA reference's loss

    def topk(self, call, index_query, index_weights, index_topk):
        return indexer_topk(index_query, call.index_key, index_weights, call.query_pos,
                            index_topk, call.query_start)

    def attend(self, call, query, kv_up_weight, picks, keep):
        q_latent, scores, latent_sel = absorbed_scores(call, query, kv_up_weight, picks.indices)
        probs = torch.softmax(scores, dim=-1)
        output = picked_output(call, probs, latent_sel, kv_up_weight, query.shape)
        stats = (softmax_stats(q_latent, query, call.qk_head_dim, scores)
                 if keep is LossReads.STATS else None)
        return Attended(output, probs.detach() if keep is LossReads.PROBS else None, stats)

    def loss(self, call, attended, picks, index_query, index_weights, coeff, tp_group):
        target = attention_target(attended.probs)
        if tp_group is not None:  # every head of the group: the sum of the ranks' head sums
            dist.all_reduce(target, group=tp_group)
        return indexer_loss(target, picks.scores, picks.indices >= 0, coeff)

    def loss_all_keys(self, call, query, kv_up_weight, picks, index_query, index_weights,
                      coeff, tp_group):
        """The loss against :func:`all_keys_probs`, as MindSpeed-LLM's torch loss behind
        its sparse flash attention computes it: an empty pick (-1) reads the last key, as
        a valid one (its score stays -inf)."""
        last = call.latent.shape[0] - 1
        read = picks._replace(indices=torch.where(picks.indices < 0, last, picks.indices))
        probs = all_keys_probs(call, query, kv_up_weight, read.indices)
        return self.loss(call, Attended(None, probs), read, index_query, index_weights, coeff,
                         tp_group)

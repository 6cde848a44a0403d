"""The sparse MLA (DSA) stages on torch_npu's fused ops, the ones MindSpeed-LLM's fused
DSA paths call.

Every stage runs per chunk of this rank's queries (a run of consecutive global positions:
one under the contiguous layout, two under zigzag) against the gathered key prefix
``[0, chunk end)`` with ``sparse_mode=3`` (causal from the lower-right vertex: the
chunk's last query sees the whole prefix), as the host's kvallgather functions do; the
keys are slices of the one packed gather, so no stage adds a collective for keys.
With packed documents (micro-batch 1) each run of consecutive query positions is still
one op call, in the ops' TND layout: its queries cut at the document boundaries are the
TND sequences, each against its document's keys ``[document start, piece end)`` (these
ranges tile the run's key range, so they are one slice of the gathered keys), with
cumulative query and key lengths; sparse_mode=3 is then causal inside each document. The
ops count a sequence's picks from its own first key, the query's document start, hence
the shifts to and from global positions (:func:`_to_global`, :func:`_to_slice`).

- indexer: ``npu_lightning_indexer`` on bfloat16 copies of the index query, key and
  weights (the host's cast, so the picks are the host's), ``return_value=True``; the
  prefix starts at position 0, so its indices are global positions (-1: no key); the
  scores carry the op's gradient.
- attention: ``npu_sparse_flash_attention`` with ``attention_mode=2`` (MLA-absorb): the
  query ``q_nope @ W_UK`` per head [b, s_c, n, d_c], key = value = the latent prefix
  [b, end, 1, d_c], the rope parts as query_rope / key_rope; its output through W_UV.
  It returns the softmax max/sum the fused loss recomputes the attention from.
- loss: ``npu_sparse_lightning_indexer_grad_kl_loss``, which returns the summed loss and
  its grads to the index query, index key and index weights; :class:`_IndexerKLLoss`
  hands them to autograd (the index key's reaches the gathered tensor, hence the gather's
  reduce-scatter). With ``tp_group`` the target sums the attention of every head of the
  group: the absorbed query, its rope part and the softmax statistics are all-gathered
  along heads first (detached: the attention gets no gradient from the loss).
"""
from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from .absorbed import attention_probs
from .indexer import TopK
from .op_calls import op_calls
from .stage import AbsorbedStats, Attended, LossReads, SparseDims, SparseKernel

# what the ops take, per SparseDims field: the last dims (kv_lora_rank, rope, index head
# dim) and the head counts (the loss's query heads: every head of loss_tp_group)
OP_DIMS = SparseDims(kv_latent=(512,), k_pos_emb=(64,), index_key=(128,),
                     heads=(1, 2, 4, 8, 16, 32, 64, 128), loss_heads=(8, 16, 32, 64, 128),
                     index_heads=(8, 16, 32, 64), index_topk=range(1, 2049))
# the SparseDims fields each stage's op is limited in
STAGE_INPUTS = {"indexer": ("index_key", "index_topk"),
                "attention": ("kv_latent", "k_pos_emb", "heads"),
                "loss": ("kv_latent", "k_pos_emb", "index_key", "loss_heads", "index_heads")}
# how a message names a field
_SHOWN = {"kv_latent": "kv_latent's last dim", "k_pos_emb": "k_pos_emb's last dim",
          "index_key": "index_key's last dim", "loss_heads": "loss heads",
          "index_heads": "index heads"}


def _torch_npu():
    return importlib.import_module("torch_npu")


class SparseNpu(SparseKernel):
    name = "npu"
    loss_reads = LossReads.STATS
    # the host's flag (argparse dest) that selects this kernel for each stage; the fused
    # loss runs only on the host's absorbed path (patches/mindspeed_llm/dsa.py)
    host_flags = {"indexer": "use_fused_lightning_indexer",
                  "attention": "use_sparse_flash_attn",
                  "loss": "use_fused_lightning_indexer_loss"}
    rounds_index_scores = True       # the op runs on bfloat16 copies, as the host's
    loss_reads_index_scores = False  # the fused loss recomputes them from the index inputs

    def check(self, stage, argument, dims):
        try:
            _torch_npu()
        except ImportError as exc:
            raise ValueError(f"{argument}='npu' needs torch_npu (Ascend CANN + torch_npu "
                             f"matching your torch); elsewhere use {argument}='torch'") from exc
        for field in STAGE_INPUTS[stage]:
            got, allowed = getattr(dims, field), getattr(OP_DIMS, field)
            if got not in allowed:
                raise ValueError(f"{argument}='npu': the fused op takes "
                                 f"{_SHOWN.get(field, field)} in {allowed} only, got {got}; "
                                 f"use {argument}='torch'")

    def topk(self, call, index_query, index_weights, index_topk):
        keys = call.index_key.transpose(0, 1).unsqueeze(2).to(torch.bfloat16)  # [b, S, 1, D]
        query = index_query.transpose(0, 1).to(torch.bfloat16)
        weights = index_weights.transpose(0, 1).to(torch.bfloat16)
        indices, scores = [], []
        for op in op_calls(call):
            picked, value = _torch_npu().npu_lightning_indexer(
                op.part(query), op.part(keys, keys=True), op.part(weights),
                **op.lengths("actual_seq_lengths_query", "actual_seq_lengths_key"),
                layout_query=op.layout, layout_key=op.layout, sparse_count=index_topk,
                sparse_mode=3, return_value=True)
            indices.append(_to_global(op.batched(picked).squeeze(2), op.first_key))
            scores.append(op.batched(value).squeeze(2))
        count = min(index_topk, keys.shape[1])  # the slots past the sequence are all -1
        return TopK(torch.cat(indices, dim=1)[..., :count].long(),
                    torch.cat(scores, dim=1)[..., :count])

    def attend(self, call, query, kv_up_weight, picks, keep):
        s, b, n, _ = query.shape
        weight = kv_up_weight.view(n, call.qk_head_dim + call.v_head_dim, -1)
        w_uk, w_uv = weight[:, :call.qk_head_dim], weight[:, call.qk_head_dim:]
        q_latent = torch.einsum("sbnd,ndc->bsnc", query[..., :call.qk_head_dim], w_uk)
        q_rope = query[..., call.qk_head_dim:].transpose(0, 1)
        latent, k_rope = (x.transpose(0, 1).unsqueeze(2) for x in (call.latent, call.k_pe))
        indices = picks.indices.unsqueeze(2).to(torch.int32)  # [b, s, 1, k]
        outs, maxes, sums = [], [], []
        for op in op_calls(call):
            key = op.part(latent, keys=True)
            out, softmax_max, softmax_sum = _torch_npu().npu_sparse_flash_attention(
                op.part(q_latent), key, key,
                sparse_indices=_to_slice(op.part(indices), op.first_key),
                scale_value=call.softmax_scale,
                query_rope=op.part(q_rope), key_rope=op.part(k_rope, keys=True),
                **op.lengths("actual_seq_lengths_query", "actual_seq_lengths_kv"),
                sparse_block_size=1, layout_query=op.layout, layout_kv=op.layout,
                sparse_mode=3, attention_mode=2, return_softmax_lse=True)
            outs.append(op.batched(out))
            maxes.append(op.batched_stats(softmax_max))
            sums.append(op.batched_stats(softmax_sum))
        output = torch.einsum("bsnc,nvc->sbnv", torch.cat(outs, dim=1), w_uv)
        stats = None
        if keep is LossReads.STATS:
            stats = AbsorbedStats(q_latent.detach(), q_rope.detach(), torch.cat(maxes, dim=2),
                                  torch.cat(sums, dim=2))
        probs = (attention_probs(call, query, kv_up_weight, picks)
                 if keep is LossReads.PROBS else None)
        return Attended(output.reshape(s, b, n * call.v_head_dim), probs, stats)

    def loss(self, call, attended, picks, index_query, index_weights, coeff, tp_group):
        stats = attended.stats
        if tp_group is not None:  # heads on dim 2 of the query parts, 3 of the statistics
            stats = AbsorbedStats(*(_gather_heads(x, tp_group, dim)
                                    for x, dim in zip(stats, (2, 2, 3, 3))))
        key, key_rope = (x.detach().transpose(0, 1).unsqueeze(2) for x in (call.latent, call.k_pe))
        key_index = call.index_key.transpose(0, 1).unsqueeze(2)  # [b, S, 1, D], with grad
        indices = picks.indices.unsqueeze(2).to(torch.int32)
        total = 0
        for op in op_calls(call):
            fixed = dict(query=op.part(stats.query), key=op.part(key, keys=True),
                         sparse_indices=_to_slice(op.part(indices), op.first_key),
                         softmax_max=op.part_stats(stats.softmax_max),
                         softmax_sum=op.part_stats(stats.softmax_sum),
                         scale_value=call.softmax_scale, query_rope=op.part(stats.query_rope),
                         key_rope=op.part(key_rope, keys=True), layout=op.layout,
                         **op.lengths("actual_seq_qlen", "actual_seq_klen", as_list=True))
            total = total + _IndexerKLLoss.apply(
                op.part(index_query.transpose(0, 1)), op.part(key_index, keys=True),
                op.part(index_weights.transpose(0, 1)), fixed)
        s, b = index_query.shape[:2]
        return total / (s * b) * coeff  # the op sums over query rows: this rank's mean


def _to_global(indices, first_key):
    """An op's picks (counted from its sequence's first key, -1: none) as global positions;
    ``first_key``: 0 (BSND against the prefix) or [s] each query row's document start."""
    if isinstance(first_key, int):  # the key prefix starts at position 0
        return indices
    return torch.where(indices >= 0, indices + first_key.to(indices.dtype).view(1, -1, 1), indices)


def _to_slice(indices, first_key):
    """Global picks [b, s, 1, k] (-1: none) counted from each sequence's first key, in the
    layout the op reads (TND: [s, 1, k])."""
    if isinstance(first_key, int):
        return indices
    return torch.where(indices >= 0, indices - first_key.to(indices.dtype).view(-1, 1, 1), indices)


class _IndexerKLLoss(torch.autograd.Function):
    """The fused KL loss (summed over query rows) of the index query, index key and index
    weights; the op computes their grads in the forward, the backward scales them."""

    @staticmethod
    def forward(ctx, query_index, key_index, weights, fixed):
        d_query_index, d_key_index, d_weights, loss = \
            _torch_npu().npu_sparse_lightning_indexer_grad_kl_loss(
                fixed["query"], fixed["key"], query_index, key_index, weights,
                fixed["sparse_indices"], fixed["softmax_max"], fixed["softmax_sum"],
                scale_value=fixed["scale_value"], query_rope=fixed["query_rope"],
                key_rope=fixed["key_rope"], layout=fixed["layout"], sparse_mode=3,
                **{k: fixed[k] for k in ("actual_seq_qlen", "actual_seq_klen") if k in fixed})
        ctx.save_for_backward(d_query_index, d_key_index, d_weights)
        return loss[0]

    @staticmethod
    def backward(ctx, grad):
        return (*((g * grad).to(g.dtype) for g in ctx.saved_tensors), None)


def _gather_heads(x, group, dim):
    """``x`` of every rank of ``group`` concatenated along ``dim``, in rank order (the
    heads a TP rank holds); not a CP collective, so the byte counter does not record it."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)

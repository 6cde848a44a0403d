"""LAGA for sparse MLA (DSA: DeepSeek-V3.2, GLM-5): one gather per layer.

DSA's attention is absorbed MQA over the latent: every head of a query attends the
same selected keys, each key being ``[kv_latent | k_pos_emb]`` (W_UK folded into the
query, W_UV into the output). The indexer that selects them needs one more per-key
tensor, its index key. So a rank needs, of every other rank's tokens, exactly
``[kv_latent | k_pos_emb | index_key]`` (512 + 64 + 128 = 704 values per token at
DeepSeek-V3.2's dims), and one all-gather of that concatenation serves the indexer's
scores and top-k, the sparse attention and the indexer's KL loss; its backward is one
reduce-scatter. Queries, the index queries and the index weights stay local.

A layer that reuses an earlier layer's picks (GLM-5.2's shared top-k: ``topk_indices``,
the picks an earlier call returned) runs no indexer and no loss, so it gathers
``[kv_latent | k_pos_emb]`` only (576 values per token at those dims).

Each stage (the indexer's top-k, the attention, the indexer's loss) runs on the kernel
its argument names (``sparse/registry.py``): "torch", the math of ``sparse/torch_stages.py``
(the attention over the picked keys gathered per query, in the inputs' dtype; the indexer
as ``sparse/indexer.py`` describes it), or "npu", torch_npu's fused ops of
``sparse/npu_stages.py``, run per chunk of this rank's queries against the gathered key
prefix. Both read the keys of the one gather. The arguments are checked in one place,
``sparse/checks.py``, before any collective.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch

from .. import agreement, comm, layout as layouts
from ..agreement import inband
from ..agreement.fields import FLAGS
from ..vocab.documents import doc_pieces, document_of
from ..vocab.segments import Segment
from .checks import SparseOptions, check_call
from .indexer import TopK
from .stage import Chunk, SparseCall


class SparseResult(NamedTuple):
    output: torch.Tensor                  # [s, b, n*v_head_dim], the input of linear_proj
    topk_indices: torch.Tensor            # [b, s, k] global key positions, -1: no key
    indexer_loss: Optional[torch.Tensor]  # scalar (this rank's mean), or None


def sparse_laga_attention(query, kv_latent, k_pos_emb, kv_up_weight, index_query, index_key,
                          index_weights, *, index_topk: int, softmax_scale: float,
                          qk_head_dim: int, v_head_dim: int, cp_group=None,
                          layout: str = "zigzag", indexer_loss_coeff: Optional[float] = None,
                          indexer_kernel: str = "torch", attention_kernel: str = "torch",
                          loss_kernel: str = "torch", loss_tp_group=None,
                          loss_target: str = "picks",
                          check_ranks: Optional[bool] = None, cu_seqlens=None,
                          topk_indices: Optional[torch.Tensor] = None) -> SparseResult:
    """Sparse MLA of this rank's queries over the whole sequence, one gather per call.

    Local tensors (s = this rank's tokens, rope applied at their global positions):
    ``query`` [s, b, n, qk_head_dim + d_r], ``kv_latent`` [s, b, d_c], ``k_pos_emb``
    [s, b, d_r], ``kv_up_weight`` [n*(qk_head_dim + v_head_dim), d_c], ``index_query``
    [s, b, H, D], ``index_key`` [s, b, D], ``index_weights`` [s, b, H] (scales applied).
    ``layout``: how the sequence is split over ``cp_group`` ("contiguous" or "zigzag").
    ``indexer_loss_coeff``: None, no loss; else the KL loss times it, this rank's mean
    over its queries (the attention probabilities it reads pass no gradient).
    ``indexer_kernel``, ``attention_kernel``, ``loss_kernel``: each stage's kernel, one of
    ``sparse.registry.SPARSE_KERNELS`` ("torch": plain torch; "npu": torch_npu's
    fused ops per chunk of queries against the gathered key prefix), any combination.
    ``loss_tp_group``: the group the query heads are split over (tensor parallel): the
    loss's target sums the attention over every head of the group (None: this rank's).
    ``loss_target``: "picks", the loss's target is the attention's own probabilities at
    the picks; "all_keys" (a loss kernel declaring ``supports_all_keys``: torch), each
    head's softmax over every key of the sequence, unmasked, read at the picks, an empty
    pick reading the last key: what
    MindSpeed-LLM's torch loss computes behind its sparse flash attention, which hands it
    no mask (kept so a model trains the same with LAGA as without).
    ``check_ranks``: as in ``laga_attention``: the CP ranks agree on every value above and
    on the shapes, dtype and requires-grad pattern before the gather, once per
    micro-batch (``new_micro_batch``) or on every call of a group that opens none.
    ``cu_seqlens``: packed documents, as in ``laga_attention`` (the global boundaries
    0 ... S in position order, the same on every rank, micro-batch 1): a query's top-k,
    its attention and its loss's target read only keys of its own document at positions
    <= its own; the boundaries are part of the ranks' agreement. Not with
    ``loss_target="all_keys"`` (refused by name).
    ``topk_indices``: given picks, [b, s, k] int32/int64 global key positions (-1: no key;
    an earlier call's ``SparseResult.topk_indices`` over the same tokens, ``k <=
    index_topk``): the call runs no indexer and no loss (``index_query``, ``index_key``,
    ``index_weights`` and ``indexer_loss_coeff`` must be None), gathers no index key, and
    returns the picks it attended; the ranks agree on whether picks are given and on their
    k. -1 is a legitimate pick, as the indexer gives it (a query with fewer visible keys
    than k). Checked on the device, with no read: a row holding a pick no query may attend
    (outside [0, S), past its position, before its document's start) attends nothing and
    returns NaN, as a row of only -1 does; the next exchange or ``settle`` raises on every
    rank naming ``topk_indices`` (without CP: this call raises).
    """
    tensors = (query, kv_latent, k_pos_emb, kv_up_weight, index_query, index_key,
               index_weights)
    setup = check_call(tensors, SparseOptions(
                      index_topk=index_topk, softmax_scale=softmax_scale, qk_head_dim=qk_head_dim,
                      v_head_dim=v_head_dim, cp_group=cp_group, layout=layout,
                      indexer_loss_coeff=indexer_loss_coeff, indexer_kernel=indexer_kernel,
                      attention_kernel=attention_kernel, loss_kernel=loss_kernel,
                      loss_tp_group=loss_tp_group, loss_target=loss_target,
                      cu_seqlens=cu_seqlens), check_ranks, topk_indices)
    stages, s = setup.stages, setup.local_len
    size, rank = setup.cp_size, setup.cp_rank
    latent, k_pe, keys = _gather_keys(kv_latent, k_pos_emb, index_key, cp_group, layout)
    chunks = query_chunks(layout, size, rank, s, setup.documents)
    call = SparseCall(latent, k_pe, keys, layouts.positions(layout, size, rank, s).to(query.device),
                      chunks, softmax_scale, qk_head_dim, v_head_dim,
                      _query_starts(chunks, setup.documents, query.device))
    if topk_indices is not None:  # another layer's picks: no indexer, no scores, no loss
        picks = TopK(given_picks(call, topk_indices, cp_group), None)
    else:
        picks = stages.indexer.topk(call, index_query, index_weights, index_topk)
    attended = stages.attention.attend(call, query, kv_up_weight, picks,
                                       None if setup.all_keys else stages.keep)
    loss = None
    if setup.all_keys:
        loss = stages.loss.loss_all_keys(call, query, kv_up_weight, picks, index_query,
                                         index_weights, indexer_loss_coeff, loss_tp_group)
    elif setup.with_loss:
        loss = stages.loss.loss(call, attended, picks, index_query, index_weights,
                                indexer_loss_coeff, loss_tp_group)
    return SparseResult(attended.output, picks.indices, loss)


def given_picks(call: SparseCall, picks: torch.Tensor, cp_group) -> torch.Tensor:
    """Given picks as the stages read them, checked on the device (no read): a row holding a
    pick no query may attend (outside [0, S), past its position, before its document's
    start) becomes a row of -1, which attends nothing and returns NaN, as does a row of only
    -1 (the indexer never gives one: a query sees itself). Either raises at the next
    exchange or settle on every rank, naming topk_indices (at CP = 1: here)."""
    pos = call.query_pos.view(1, -1, 1)
    low = 0 if call.query_start is None else call.query_start.view(1, -1, 1)
    visible = (picks >= low) & (picks <= pos)
    bad_row = (~(visible | (picks == -1))).any(-1, keepdim=True)
    wrong = (bad_row | ~visible.any(-1, keepdim=True)).any()
    if comm.group_size(cp_group) > 1:
        agreement.flag(cp_group, "topk_indices", wrong)
    elif wrong:  # no peer to tell and no later agreement: this call raises
        raise ValueError(f"topk_indices {FLAGS['topk_indices']}; pass valid picks")
    return torch.where(bad_row, torch.full_like(picks, -1), picks)


def query_chunks(layout: str, size: int, rank: int, local_len: int, documents) -> List[Chunk]:
    """This rank's runs of consecutive query positions, cut at the document boundaries
    (host ints only: no device value is read)."""
    chunks = []
    for segment in layouts.rank_segments(layout, size, rank, local_len):
        for start, length, first in doc_pieces(Segment(*segment), documents):
            key_start = 0 if documents is None else documents[document_of(first, documents)]
            chunks.append(Chunk(start, length, first + length, key_start))
    return chunks


def _query_starts(chunks: List[Chunk], documents, device) -> Optional[torch.Tensor]:
    """[s] each local query's document start (None without documents), in local order."""
    if documents is None:
        return None
    starts = torch.tensor([chunk.key_start for chunk in chunks], dtype=torch.long)
    lengths = torch.tensor([chunk.length for chunk in chunks], dtype=torch.long)
    return torch.repeat_interleave(starts, lengths).to(device)  # one per chunk, not per row


def _gather_keys(kv_latent, k_pos_emb, index_key, cp_group, layout):
    """Every position's (kv_latent, k_pos_emb, index_key), [S, b, *] in position order;
    index_key None (given picks): it is not gathered, and comes back None."""
    local = [t for t in (kv_latent, k_pos_emb, index_key) if t is not None]
    widths = [t.shape[-1] for t in local]
    packed = torch.cat(local, dim=-1)
    kind = "sparse_latent" if index_key is not None else "sparse_latent/given_picks"
    gathered = inband.gather_seq(packed, cp_group, "sparse_latent", kind)
    size = comm.group_size(cp_group)
    if not layouts.is_identity(layout, size):
        order = layouts.to_position_order(layout, size, kv_latent.shape[0])
        gathered = gathered.index_select(0, order.to(gathered.device))
    parts = torch.split(gathered, widths, dim=-1)
    return parts if index_key is not None else (*parts, None)


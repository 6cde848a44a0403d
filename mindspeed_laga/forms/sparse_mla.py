"""LAGA for sparse MLA (DSA: DeepSeek-V3.2, GLM-5): one gather per layer.

DSA's attention is absorbed MQA over the latent: every head of a query attends the
same selected keys, each key being ``[kv_latent | k_pos_emb]`` (W_UK folded into the
query, W_UV into the output). The indexer that selects them needs one more per-key
tensor, its index key. So a rank needs, of every other rank's tokens, exactly
``[kv_latent | k_pos_emb | index_key]`` (512 + 64 + 128 = 704 values per token at
DeepSeek-V3.2's dims), and one all-gather of that concatenation serves the indexer's
scores and top-k, the sparse attention and the indexer's KL loss; its backward is one
reduce-scatter. Queries, the index queries and the index weights stay local.

Each stage (the indexer's top-k, the attention, the indexer's loss) runs on the kernel
its argument names (``kernels/sparse_registry.py``): "torch", the math of
``kernels/sparse_torch.py`` (the attention over the picked keys gathered per query, in the
inputs' dtype; the indexer as ``sparse_index`` describes it), or "npu", torch_npu's fused
ops of ``kernels/sparse_npu.py``, run per chunk of this rank's queries against the
gathered key prefix. Both read the keys of the one gather.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import comm, layout as layouts
from ..kernels.sparse_base import Chunk, SparseCall
from ..kernels.sparse_registry import sparse_stages
from ..kernels.sparse_torch import all_keys_probs

LAYOUTS = ("contiguous", "zigzag")
LOSS_TARGETS = ("picks", "all_keys")


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
                          loss_target: str = "picks") -> SparseResult:
    """Sparse MLA of this rank's queries over the whole sequence, one gather per call.

    Local tensors (s = this rank's tokens, rope applied at their global positions):
    ``query`` [s, b, n, qk_head_dim + d_r], ``kv_latent`` [s, b, d_c], ``k_pos_emb``
    [s, b, d_r], ``kv_up_weight`` [n*(qk_head_dim + v_head_dim), d_c], ``index_query``
    [s, b, H, D], ``index_key`` [s, b, D], ``index_weights`` [s, b, H] (scales applied).
    ``layout``: how the sequence is split over ``cp_group`` ("contiguous" or "zigzag").
    ``indexer_loss_coeff``: None, no loss; else the KL loss times it, this rank's mean
    over its queries (the attention probabilities it reads pass no gradient).
    ``indexer_kernel``, ``attention_kernel``, ``loss_kernel``: each stage's kernel, one of
    ``kernels.sparse_registry.SPARSE_KERNELS`` ("torch": plain torch; "npu": torch_npu's
    fused ops per chunk of queries against the gathered key prefix), any combination.
    ``loss_tp_group``: the group the query heads are split over (tensor parallel): the
    loss's target sums the attention over every head of the group (None: this rank's).
    ``loss_target``: "picks", the loss's target is the attention's own probabilities at
    the picks; "all_keys" (torch loss only), each head's softmax over every key of the
    sequence, unmasked, read at the picks, an empty pick reading the last key: what
    MindSpeed-LLM's torch loss computes behind its sparse flash attention, which hands it
    no mask (kept so a model trains the same with LAGA as without).
    """
    if loss_target not in LOSS_TARGETS:
        raise ValueError(f"loss_target must be one of {LOSS_TARGETS}, got {loss_target!r}")
    if loss_target == "all_keys" and loss_kernel != "torch":
        raise ValueError("loss_target='all_keys' is a torch loss's target: use "
                         f"loss_kernel='torch' (got {loss_kernel!r}) or loss_target='picks'")
    _check(query, kv_latent, k_pos_emb, kv_up_weight, index_query, index_key, index_weights,
           index_topk, qk_head_dim, v_head_dim, layout)
    dims = {"kv_latent": kv_latent.shape[-1], "k_pos_emb": k_pos_emb.shape[-1],
            "index_key": index_key.shape[-1], "heads": query.shape[2],
            "loss heads": query.shape[2] * comm.check_group(loss_tp_group, "loss_tp_group"),
            "index heads": index_query.shape[2], "index_topk": index_topk}
    stages = sparse_stages(indexer_kernel=indexer_kernel, attention_kernel=attention_kernel,
                           loss_kernel=loss_kernel, dims=dims,
                           with_loss=indexer_loss_coeff is not None)
    size, rank, s = comm.check_group(cp_group), comm.group_rank(cp_group), query.shape[0]
    latent, k_pe, keys = _gather_keys(kv_latent, k_pos_emb, index_key, cp_group, layout)
    chunks = [Chunk(start, length, first + length)
              for start, length, first in layouts.rank_segments(layout, size, rank, s)]
    call = SparseCall(latent, k_pe, keys, layouts.positions(layout, size, rank, s).to(query.device),
                      chunks, softmax_scale, qk_head_dim, v_head_dim)
    picks = stages.indexer.topk(call, index_query, index_weights, index_topk)
    all_keys = loss_target == "all_keys" and indexer_loss_coeff is not None
    attended = stages.attention.attend(call, query, kv_up_weight, picks,
                                       None if all_keys else stages.keep)
    loss = None
    if all_keys:  # an empty pick reads the last key, as a valid one (its score stays -inf)
        read = picks._replace(indices=torch.where(picks.indices < 0, call.latent.shape[0] - 1,
                                                  picks.indices))
        attended = attended._replace(probs=all_keys_probs(call, query, kv_up_weight,
                                                          read.indices))
        loss = stages.loss.loss(call, attended, read, index_query, index_weights,
                                indexer_loss_coeff, loss_tp_group)
    elif indexer_loss_coeff is not None:
        loss = stages.loss.loss(call, attended, picks, index_query, index_weights,
                                indexer_loss_coeff, loss_tp_group)
    return SparseResult(attended.output, picks.indices, loss)


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

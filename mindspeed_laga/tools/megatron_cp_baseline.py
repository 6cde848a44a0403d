"""The CP baseline core attention for real megatron-core's unpatched MLA on CPU: per-head
K/V all-gathered over the CP group with megatron's own mapping, masks from the global
positions of megatron's zigzag layout, and TransformerEngine's semantics for packed (THD)
calls. :mod:`megatron_cpu` builds its tiny model with it."""
from __future__ import annotations

from typing import Sequence

import torch


def zigzag_positions(cp_size: int, rank: int, local_len: int) -> torch.Tensor:
    """Global positions of megatron's get_batch_on_this_cp_rank slice (chunks r, 2P-1-r)."""
    if cp_size == 1:
        return torch.arange(local_len)
    c = local_len // 2
    first, second = rank * c, (2 * cp_size - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


def thd_positions(padded_bounds: Sequence[int], cp_size: int, rank: int) -> torch.Tensor:
    """Packed positions of megatron's THD split (TE's thd_get_partitioned_indices):
    every padded document cut into 2P chunks, rank r holding chunks r and 2P-1-r."""
    if cp_size == 1:
        return torch.arange(padded_bounds[-1])
    parts = []
    for start, end in zip(padded_bounds[:-1], padded_bounds[1:]):
        c = (end - start) // (2 * cp_size)
        for chunk in (rank, 2 * cp_size - 1 - rank):
            parts.append(torch.arange(start + chunk * c, start + (chunk + 1) * c))
    return torch.cat(parts)


def _thd_visible(q_pos, k_pos, real_bounds, padded_bounds):
    """[q, k] True where megatron/TE's packed causal attention lets query q see key k:
    same document, k not after q, k a real token (not padding). A pad query sees
    only itself (its output is zeroed afterwards), so no row is empty."""
    starts = torch.tensor(padded_bounds[:-1])
    lengths = torch.tensor(real_bounds[1:]) - torch.tensor(real_bounds[:-1])

    def doc_and_offset(pos):
        doc = torch.bucketize(pos, starts, right=True) - 1
        return doc, pos - starts[doc]

    q_doc, q_off = doc_and_offset(q_pos)
    k_doc, k_off = doc_and_offset(k_pos)
    k_real = k_off < lengths[k_doc]
    q_real = q_off < lengths[q_doc]
    visible = (q_doc[:, None] == k_doc[None, :]) & (k_pos[None, :] <= q_pos[:, None]) & k_real
    return visible | (~q_real[:, None] & (q_pos[:, None] == k_pos[None, :])), q_real


class CPBaselineAttention(torch.nn.Module):
    """Plain softmax attention that serves megatron's unpatched MLA forward under CP.

    It receives per-head ``query``/``key``/``value`` [s, b, n, d] of this rank's
    zigzag tokens, all-gathers K and V over the CP group with megatron's
    ``gather_from_sequence_parallel_region`` (backward: reduce-scatter of dK,
    dV), and masks key j for query i iff pos(j) > pos(i). No reordering: the
    mask comes from true positions. Independent of mindspeed_laga on purpose.

    Packed (THD) calls, [t, n, d]: TE's semantics, attention inside each
    document over its real tokens (``cu_seqlens_q``), documents stored at their
    padded lengths (``cu_seqlens_q_padded``), pad queries output zero.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type=None,
                 attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None,
                 cp_comm_type=None, pg_collection=None):
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"CPBaselineAttention is causal only, got {attn_mask_type}")
        if config.attention_dropout:
            raise ValueError("CPBaselineAttention has no dropout; set attention_dropout=0.0")
        self.softmax_scale = softmax_scale
        self.cp_group = pg_collection.cp

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **unused):
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
        if packed_seq_params is not None:
            return self._thd_forward(query, key, value, packed_seq_params)
        if attention_mask is not None:
            raise ValueError("CPBaselineAttention takes attention_mask=None")
        size, rank = self.cp_group.size(), self.cp_group.rank()
        s = query.shape[0]
        q_pos = zigzag_positions(size, rank, s)
        k_pos = torch.cat([zigzag_positions(size, r, s) for r in range(size)])
        if size > 1:
            key = gather_from_sequence_parallel_region(key, True, group=self.cp_group)
            value = gather_from_sequence_parallel_region(value, True, group=self.cp_group)
        scores = torch.einsum("sbnd,tbnd->bnst", query, key) * self.softmax_scale
        hidden = (k_pos[None, :] > q_pos[:, None]).to(query.device)
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        out = torch.einsum("bnst,tbnv->sbnv", probs, value)
        return out.reshape(s, query.shape[1], -1)

    def _thd_forward(self, query, key, value, params):
        """[t, n, d] of this rank's THD tokens -> [t, n*d_v]."""
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
        if params.qkv_format != "thd":
            raise ValueError("CPBaselineAttention takes packed sequences in THD format only")
        real = [int(x) for x in params.cu_seqlens_q.tolist()]
        padded = real if params.cu_seqlens_q_padded is None else \
            [int(x) for x in params.cu_seqlens_q_padded.tolist()]
        size, rank = self.cp_group.size(), self.cp_group.rank()
        q_pos = thd_positions(padded, size, rank)
        k_pos = torch.cat([thd_positions(padded, size, r) for r in range(size)])
        if size > 1:
            key = gather_from_sequence_parallel_region(key, True, group=self.cp_group)
            value = gather_from_sequence_parallel_region(value, True, group=self.cp_group)
        visible, q_real = _thd_visible(q_pos, k_pos, real, padded)
        scores = torch.einsum("snd,tnd->nst", query, key) * self.softmax_scale
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out = torch.einsum("nst,tnv->snv", probs, value) * q_real[:, None, None].to(query.dtype)
        return out.reshape(query.shape[0], -1)

"""Packed (THD) batches of megatron-core on the LAGA path.

megatron-core packs a micro-batch of documents into one sequence
(``packed_seq_params.qkv_format == "thd"``, hidden ``[t, 1, h]``) and, under
CP, splits every document into 2P chunks, rank r holding chunks r and 2P-1-r
of each, documents in order (``get_thd_batch_on_this_cp_rank``, i.e.
TransformerEngine's ``thd_get_partitioned_indices`` over
``cu_seqlens_q_padded``). That is the core's ``layout="doc_zigzag"`` with
``cu_seqlens`` = the (padded) global document boundaries.

Padding: when ``cu_seqlens_q_padded`` is set, every document is stored at its
padded length (real tokens first, pad tokens after them) and the split cuts
the padded documents. LAGA takes the padded boundaries as the documents, so a
pad token belongs to its padded document. Under the causal mask a real token
sees only the tokens before it in its document, all real: its output (and
every gradient reaching it) equals megatron's, which ignores the pad tokens.
Only the pad tokens' own outputs differ (they attend their document's prefix),
which is why the loss mask must exclude them, as megatron's does. Non-causal
attention would let real tokens see pads, so padded THD needs the causal mask.

Rope follows megatron's ``_apply_rotary_pos_emb_thd``: a token's position is
its offset in its padded document, except when the rope table is exactly as
long as the packed sequence (then the packed position).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from mindspeed_laga import layout as layouts
from mindspeed_laga.cp_algos import algo


@dataclass(frozen=True)
class PackedBatch:
    """What the LAGA path needs from ``packed_seq_params`` (THD)."""

    documents: Tuple[int, ...]   # global (padded) document boundaries 0 ... T
    rope_rows: int               # the length of megatron's rope table for this batch
    padded: bool                 # cu_seqlens_q_padded differs from cu_seqlens_q


def is_thd(packed_seq_params) -> bool:
    return packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd"


def _bounds(tensor) -> Optional[Tuple[int, ...]]:
    return None if tensor is None else tuple(int(x) for x in tensor.tolist())


def _same(name_q: str, q, name_kv: str, kv):
    if q != kv:
        raise ValueError(
            f"mindspeed_laga.patch_megatron_mla: packed_seq_params.{name_q}={list(q or ())} "
            f"differs from packed_seq_params.{name_kv}={list(kv or ())}; LAGA runs self-attention "
            f"on packed documents and needs the same boundaries for queries and keys (set "
            f"{name_kv} = {name_q})")


def packed_batch(packed_seq_params, hidden_states, cp_size: int, causal: bool,
                 cp_algo: str, layout: str) -> PackedBatch:
    """Check a THD call (ValueError naming the argument and the fix) -> PackedBatch.

    Runs on every CP rank before any collective: every value it reads is the
    same on all of them (megatron hands every CP rank the same packed_seq_params).
    """
    p = packed_seq_params
    if hidden_states.shape[1] != 1:
        raise ValueError(f"mindspeed_laga.patch_megatron_mla: packed (THD) sequences carry the "
                         f"batch in the packed dimension (micro-batch 1), got hidden_states of "
                         f"shape {tuple(hidden_states.shape)}; pack the micro-batch into one sequence")
    real_q, real_kv = _bounds(p.cu_seqlens_q), _bounds(p.cu_seqlens_kv)
    _same("cu_seqlens_q", real_q, "cu_seqlens_kv", real_kv)
    pad_q, pad_kv = _bounds(p.cu_seqlens_q_padded), _bounds(p.cu_seqlens_kv_padded)
    _same("cu_seqlens_q_padded", pad_q, "cu_seqlens_kv_padded", pad_kv)
    documents = pad_q if pad_q is not None else real_q
    if documents is None:
        raise ValueError("mindspeed_laga.patch_megatron_mla: packed_seq_params.cu_seqlens_q is "
                         "None; THD batches need the document boundaries")
    padded = pad_q is not None and pad_q != real_q
    if padded and not causal:
        raise ValueError("mindspeed_laga.patch_megatron_mla: padded THD documents "
                         "(cu_seqlens_q_padded != cu_seqlens_q) need attn_mask_type=causal: "
                         "without the causal mask real tokens would attend the pad tokens; "
                         "pack without padding or use causal attention")
    if algo(cp_algo).takes_ulysses_degree:
        raise ValueError("mindspeed_laga.patch_megatron_mla(cp_algo='hybrid') does not take "
                         "packed (THD) sequences: megatron splits THD batches per document "
                         "(doc_zigzag), which has no hybrid form; use cp_algo='allgather' or "
                         "'ulysses' for packed sequences")
    if layout != "zigzag":
        raise ValueError(f"mindspeed_laga.patch_megatron_mla(layout={layout!r}) does not take "
                         "packed (THD) sequences: megatron splits them per document "
                         "(get_thd_batch_on_this_cp_rank), which the patch follows with "
                         "layout='zigzag' (the default)")
    total = hidden_states.shape[0] * cp_size
    if documents[-1] != total:
        raise ValueError(f"mindspeed_laga.patch_megatron_mla: packed_seq_params' document "
                         f"boundaries end at {documents[-1]}, but the packed sequence holds "
                         f"{total} tokens (local {hidden_states.shape[0]} x CP {cp_size}); pass "
                         "cu_seqlens_q_padded when the documents are padded")
    rope_rows = max(int(p.max_seqlen_q or 0), int(p.max_seqlen_kv or 0))
    return PackedBatch(documents=documents, rope_rows=rope_rows, padded=padded)


def packed_rope_positions(packed: PackedBatch, cp_size: int, rank: int,
                          local_len: int) -> Tuple[torch.Tensor, int]:
    """(rope position of each local token, rows of the rope table to build).

    megatron's rule: the offset in the padded document, or the packed position
    when the table is as long as the packed sequence.
    """
    documents = packed.documents
    positions = layouts.positions("doc_zigzag", cp_size, rank, local_len, documents)
    if packed.rope_rows == documents[-1]:
        return positions, packed.rope_rows
    starts = torch.tensor(documents[:-1])
    doc = torch.bucketize(positions, starts, right=True) - 1
    longest = max(b - a for a, b in zip(documents[:-1], documents[1:]))
    return positions - starts[doc], max(packed.rope_rows, longest)

"""Absorbed (latent-space) MLA under CP, ported to training as the paper did.

W_UK is folded into the query (``q_abs = [q_nope . W_UK, q_pe]``, n x (d_c+d_r)
per token), the latent ``[kv_latent, k_pos_emb]`` is all-gathered, attention
runs in latent space with one key/value head shared by every query head
(key = the 576-wide latent, value = its 512-wide kv part), and W_UV is applied
to the latent-space output. Nothing is done to hide its cost: ``q_abs`` and
the latent-space output (n x d_c per token) are real activations kept for
backward, which is the memory trap this form exists to measure.

ulysses: q_abs is all-to-all'd to head-split (as in the paper), the latent is
all-gathered, W_UV is applied on the head-split side and O all-to-all'd back.
hybrid: the same, the all-to-alls inside the Ulysses group, the latent
gathered over the whole CP group.
"""
from __future__ import annotations

import torch

from ..kernels import attend, nonfinite
from ..vocab.attn_setup import AttnSetup
from .common import (all_heads, empty_fill, flatten_heads, from_bnsd, heads_to_seq, seq_to_heads,
                     split_latent, split_up_weight, to_bnsd)
from .latent_source import SyncLatent


def absorbed_forward(query, kv_latent, k_pos_emb, kv_up_weight, setup: AttnSetup):
    d = setup.dims
    full = not setup.heads_split
    w_uk, _ = split_up_weight(kv_up_weight, all_heads(setup))
    q_nope, q_pe = torch.split(query, [d.qk_head_dim, d.rope_dim], dim=-1)
    q_abs = torch.cat([torch.einsum("sbnd,ndc->sbnc", q_nope, w_uk), q_pe], dim=-1)
    if not full:
        q_abs = seq_to_heads(q_abs, setup, "query")
    kv_all, k_pe_all, bad = _latent_parts(kv_latent, k_pos_emb, setup)
    key = torch.cat([kv_all, k_pe_all], dim=-1).unsqueeze(2)  # [S, b, 1, d_c+d_r]
    value = kv_all.unsqueeze(2)                                 # [S, b, 1, d_c]
    _, w_uv = split_up_weight(kv_up_weight, setup)  # this rank's heads
    # o = o_latent . W_UV^T per query segment, before the segments are concatenated:
    # the einsum then keeps the kernel's own output [b, h, s_q, d_c] for backward
    # (a view at micro-batch 1; its batched matmul copies it when b > 1)
    out = attend(to_bnsd(q_abs), to_bnsd(key), to_bnsd(value), scale=setup.softmax_scale,
                 segments=setup.query_segments(), causal=setup.causal, kernel=setup.kernel,
                 documents=setup.documents,
                 bad=bad,  # with CP: found and zeroed in the gathered latent
                 key_padding=setup.key_padding,
                 empty_fill=empty_fill(value, setup),
                 epilogue=lambda o_latent: torch.einsum("bnsc,nvc->bnsv", o_latent, w_uv))
    out = from_bnsd(out)
    if not full:
        out = heads_to_seq(out, setup, "output")
    return flatten_heads(out)


def _latent_parts(kv_latent, k_pos_emb, setup: AttnSetup):
    """(kv part, rope key, non-finite positions [b, 1, S] or None). With CP the gathered
    latent is this call's own: its non-finite positions are zeroed in it before it is
    split (its parts are views the kernels keep); without CP the parts are the caller's
    tensors, which attend copies where it must zero."""
    source = SyncLatent(kv_latent, k_pos_emb)
    if setup.cp_size == 1:
        return (*source.parts(setup), None)
    latent = source.latent(setup)
    bad = nonfinite.bad_positions(latent)  # [S, b]
    nonfinite.zero_bad_positions(latent, bad, in_place=True)
    return (*split_latent(latent, setup), bad.t().unsqueeze(1))

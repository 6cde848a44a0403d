"""LAGA: all-gather the latent, rebuild per-head K/V locally, ordinary attention.

allgather: all-gather ``[kv_latent, k_pos_emb]`` (d_c + d_r values per token;
backward reduce-scatters its gradient), up-project the gathered latent to
per-head K/V for every head, attend the local queries.
ulysses: all-to-all Q to head-split, all-gather the latent, rebuild K/V for
this rank's n/P heads only (their rows of ``kv_up_weight``), attend the whole
sequence, all-to-all O back.
hybrid: as ulysses, but Q and O cross only the Ulysses group (U ranks); the
latent is still gathered over the whole CP group and K/V rebuilt for n/U heads.

By default this is the paper's form: K/V are rebuilt in full and kept by
autograd for backward. Options:

- ``trim_causal_prefix``: rebuild only keys some local query can see.
- ``recompute_kv`` / ``kv_block_size``: keep only the latent; rebuild K/V per
  block in forward and again in backward (``laga_blockwise``).
- ``latent_gather``: a gather started earlier by ``start_latent_gather``
  (``latent_source.py``; forward overlaps the query projection, backward
  overlaps the dq work).
"""
from __future__ import annotations

import torch

from ..kernels import attend
from ..key_padding import empty_rows
from ..options import LagaOptions
from ..vocab.attn_setup import AttnSetup
from .common import (empty_fill_latent, flatten_heads, from_bnsd, heads_to_seq, seq_to_heads, take_ranges, to_bnsd,
                     up_project, up_weight_rows)
from .laga_blockwise import BlockPlan, BlockwiseLAGA
from .latent_source import SyncLatent


def laga_forward(query, kv_latent, k_pos_emb, kv_up_weight, setup: AttnSetup,
                 options: LagaOptions = LagaOptions()):
    source = options.latent_gather or SyncLatent(kv_latent, k_pos_emb)
    if setup.heads_split:
        query = seq_to_heads(query, setup, "query")
    if options.recompute_kv:
        out = _attend_blockwise(query, source.latent(setup), kv_up_weight, setup,
                                options.trim_causal_prefix, options.kv_block_size)
    else:
        kv_all, k_pe_all = source.parts(setup)
        out = _attend_rebuilt(query, kv_all, k_pe_all, kv_up_weight, setup,
                              options.trim_causal_prefix, options.kv_up_linear)
    if setup.heads_split:
        out = heads_to_seq(out, setup, "output")
    return flatten_heads(out)


def _attend_rebuilt(query, kv_all, k_pe_all, kv_up_weight, setup, trim_causal_prefix,
                    kv_up_linear=None):
    """The paper's LAGA: rebuild K/V for every (visible) key; autograd keeps them.
    ``kv_up_linear``: the up-projection to call instead of F.linear (None: F.linear)."""
    ranges = setup.key_ranges() if trim_causal_prefix else None
    fill = empty_fill_latent(kv_all, kv_up_weight, setup)
    if ranges:
        kv_all, k_pe_all = take_ranges(kv_all, ranges), take_ranges(k_pe_all, ranges)
    key, value = up_project(kv_all, k_pe_all, kv_up_weight, setup, kv_up_linear)
    out = attend(to_bnsd(query), to_bnsd(key), to_bnsd(value), scale=setup.softmax_scale,
                 segments=setup.query_segments(), causal=setup.causal, kernel=setup.kernel,
                 documents=setup.documents, key_ranges=ranges, own_kv=True,
                 key_padding=setup.key_padding, empty_fill=fill)
    return from_bnsd(out)


def _attend_blockwise(query, latent, kv_up_weight, setup, trim_causal_prefix, kv_block_size):
    """K/V rebuilt per block in forward and again in backward; only the latent is kept."""
    ranges = setup.key_ranges() if trim_causal_prefix else None
    padding = setup.key_padding
    # from every position's latent, before trimming
    fill = empty_fill_latent(latent[..., :setup.dims.kv_lora_rank], kv_up_weight, setup)
    if ranges:
        latent = take_ranges(latent, ranges)
    weight = up_weight_rows(kv_up_weight, setup)
    plan = BlockPlan.from_setup(setup, kv_block_size, ranges)
    out = BlockwiseLAGA.apply(to_bnsd(query), latent, weight, plan)
    if padding is not None:  # rows that see no key came out zero (and pass no gradient)
        empty = empty_rows(padding, plan.segments, setup.causal)
        out = torch.where(empty, torch.zeros((), dtype=out.dtype) if fill is None
                          else fill.to(out.dtype), out)
    return from_bnsd(out)

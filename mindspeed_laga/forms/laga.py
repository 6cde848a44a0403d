"""LAGA: all-gather the latent, rebuild per-head K/V locally, ordinary attention.

allgather: all-gather ``[kv_latent, k_pos_emb]`` (d_c + d_r values per token;
backward reduce-scatters its gradient), up-project the gathered latent to
per-head K/V for every head, attend the local queries.
ulysses: all-to-all Q to head-split, all-gather the latent, rebuild K/V for
this rank's n/P heads only (their rows of ``kv_up_weight``), attend the whole
sequence, all-to-all O back.

This is the paper's form: K/V are rebuilt in full and kept by autograd for
backward. ``trim_causal_prefix`` rebuilds only the keys some local query can
see; the blockwise, recomputing variant lives in ``laga_blockwise``.
"""
from __future__ import annotations

from .. import comm
from ..kernels import attend, key_prefix
from ..validate import AttnSetup
from .common import (assemble_key, flatten_heads, from_bnsd, gather_latent, query_segments,
                     to_bnsd, up_project)


def visible_keys(setup: AttnSetup) -> int:
    """Keys (from position 0) that at least one of this rank's queries sees."""
    total = setup.local_len * setup.cp_size
    return max(key_prefix(seg, total, setup.causal) for seg in query_segments(setup))


def laga_forward(query, kv_latent, k_pos_emb, kv_up_weight, setup: AttnSetup, *,
                 trim_causal_prefix: bool = False, gathered=None):
    """``gathered``: a ``(kv_all, k_pe_all)`` pair already in position order
    (an overlapped gather); otherwise the latent is gathered here."""
    full = setup.cp_algo == "allgather" or setup.cp_size == 1
    if not full:
        query = comm.seq_to_heads(query, setup.cp_group, "query")
    kv_all, k_pe_all = gathered if gathered is not None else gather_latent(kv_latent, k_pos_emb, setup)
    if trim_causal_prefix:
        end = visible_keys(setup)
        kv_all, k_pe_all = kv_all[:end], k_pe_all[:end]
    k_nope, value = up_project(kv_all, kv_up_weight, setup)
    key = assemble_key(k_nope, k_pe_all)
    out = attend(to_bnsd(query), to_bnsd(key), to_bnsd(value), scale=setup.softmax_scale,
                 segments=query_segments(setup), causal=setup.causal, kernel=setup.kernel)
    out = from_bnsd(out)
    if not full:
        out = comm.heads_to_seq(out, setup.cp_group, "output")
    return flatten_heads(out)

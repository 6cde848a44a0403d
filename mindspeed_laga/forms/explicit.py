"""Explicit MLA under CP: per-head K/V cross the wire (today's training path).

allgather: up-project the local latent, all-gather K and V (backward
reduce-scatters dK, dV), attend the local queries.
ulysses: all-to-all Q, K, V from sequence-split to head-split, attend the
whole sequence for n/P heads, all-to-all O back.
hybrid: all-to-all Q, K, V inside the Ulysses group (U ranks) to n/U heads,
all-gather those heads' K/V over the ring group (the R = P/U ranks with the
same Ulysses rank), attend, all-to-all O back inside the Ulysses group.
"""
from __future__ import annotations

from .. import comm
from ..kernels import attend
from ..vocab.attn_setup import AttnSetup
from .common import (all_heads, empty_fill, flatten_heads, from_bnsd, heads_to_seq, seq_to_heads,
                     to_bnsd, to_position_order, up_project)


def explicit_forward(query, kv_latent, k_pos_emb, kv_up_weight, setup: AttnSetup):
    full = not setup.heads_split
    # Ulysses up-projects all local heads: the all-to-all then moves them.
    local = setup if full else all_heads(setup)
    key, value = up_project(kv_latent, k_pos_emb, kv_up_weight, local)
    group = setup.cp_group
    if full:
        key = to_position_order(comm.gather_seq(key, group, "key"), setup)
        value = to_position_order(comm.gather_seq(value, group, "value"), setup)
    else:
        query = seq_to_heads(query, setup, "query")
        every_token = setup.algo.every_token  # hybrid: gathered over the ring group too
        key = to_position_order(every_token(seq_to_heads(key, setup, "key"), setup, "key"), setup)
        value = to_position_order(every_token(seq_to_heads(value, setup, "value"), setup,
                                              "value"), setup)
    fill = empty_fill(value, setup)
    out = attend(to_bnsd(query), to_bnsd(key), to_bnsd(value), scale=setup.softmax_scale,
                 segments=setup.query_segments(), causal=setup.causal, kernel=setup.kernel,
                 documents=setup.documents, own_kv=True, key_padding=setup.key_padding,
                 empty_fill=fill)
    out = from_bnsd(out)
    if not full:
        out = heads_to_seq(out, setup, "output")
    return flatten_heads(out)


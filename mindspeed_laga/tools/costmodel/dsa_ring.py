"""Sparse MLA (DSA) under a ring or hybrid CP split, against LAGA's one gather: what each
would move and how many gathered keys it would hold at once, per layer and CP rank.

Why LAGA does not serve DSA under ``megatron_cp_algo`` (ring) or ``hybrid_cp_algo``
(docs/SPARSE_MLA.md, "Ring and hybrid CP: why LAGA's one gather does not serve them"):

- ``laga``: one all-gather of ``[kv_latent | k_pos_emb | index_key]`` (d_c + d_r + D values
  a token) forward, its reduce-scatter backward; it holds every key of the sequence at once
  (and, in backward, the gradient of that buffer before the reduce-scatter).
- ``ring``: the same keys passed around the CP ranks in P - 1 steps of one chunk of S/P
  tokens, two chunks alive at a time (the one used, the one arriving; four in backward,
  with their gradients). DSA's top-k is over
  every key of a query's causal prefix, so the picks are known only after the whole ring:
  a first pass carries the index keys (D), a second the ``[kv_latent | k_pos_emb]`` the
  picks read (d_c + d_r): the same values a token forward, in 2 (P - 1) steps. Backward, as
  ring attention does, the key chunks go around again beside their gradient accumulators:
  twice the values.
- ``hybrid``: the ring across groups plus Ulysses inside groups of U ranks, which moves each
  head's query and output (n (d_n + d_r) + n d_v values a token, (U - 1)/U of them leave the
  rank) all-to-all forward and again backward; every head still attends the same latent
  keys, so the keys' part stays the ring's.

Pure arithmetic on the dims; the host runs neither for DSA (MindSpeed-LLM refuses DSA
under both).
"""
from __future__ import annotations

from ...vocab.dims import ModelDims
from .dsa import IndexerDims


def ring_alternatives(dims: ModelDims, index: IndexerDims, seq_len: int, cp: int, elem: int,
                      ulysses_degree: int) -> dict:
    """Per path: values a token forward and backward, bytes a rank receives (fwd + bwd),
    sequential communication steps, and the gathered keys' peak bytes held at once."""
    if seq_len % cp or cp < 2 or not 1 < ulysses_degree < cp or cp % ulysses_degree:
        raise ValueError(f"needs S ({seq_len}) a multiple of CP ({cp}) and 1 < U ({ulysses_degree}) "
                         "< CP, U dividing CP")
    keys = dims.kv_lora_rank + dims.rope_dim + index.head_dim
    tokens = seq_len // cp
    others = cp - 1
    heads = dims.heads * (dims.qk_head_dim + dims.rope_dim) + dims.heads * dims.v_head_dim
    u = ulysses_degree
    a2a_share = (u - 1) / u  # of a token's head-split values, what leaves the rank

    def row(forward, backward, received, steps, peak):
        return {"values_per_token_forward": forward, "values_per_token_backward": backward,
                "received_bytes": received, "steps": steps, "peak_key_bytes": peak}

    chunk = tokens * keys * elem
    ring_rows = row(keys, 2 * keys, others * tokens * elem * 3 * keys, 4 * others, 4 * chunk)
    hybrid_extra = 2 * round(tokens * heads * a2a_share) * elem
    rows = {
        "laga": row(keys, keys, 2 * others * tokens * keys * elem, 2, 2 * seq_len * keys * elem),
        "ring": ring_rows,
        "hybrid": row(keys + round(heads * a2a_share), 2 * keys + round(heads * a2a_share),
                      ring_rows["received_bytes"] + hybrid_extra, ring_rows["steps"] + 4,
                      ring_rows["peak_key_bytes"]),
    }
    return {"seq_len": seq_len, "cp_size": cp, "ulysses_degree": u, "elem_bytes": elem,
            "key_values": keys, "head_values": heads, "paths": rows}

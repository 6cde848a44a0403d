"""The public functions: three MLA attention forms with one signature.

They take exactly what Megatron's MLA forward holds before core attention
(``[s, b, ...]`` layout, s = this rank's tokens, rope already applied at each
token's global position) and return the input of ``linear_proj``:

- ``query``        [s, b, n, qk_head_dim + qk_pos_emb_head_dim]
- ``kv_latent``    [s, b, kv_lora_rank] (after kv_layernorm)
- ``k_pos_emb``    [s, b, qk_pos_emb_head_dim]
- ``kv_up_weight`` [n*(qk_head_dim + v_head_dim), kv_lora_rank]
  (``linear_kv_up_proj.weight``; this TP rank's heads)
- returns          [s, b, n*v_head_dim]

Keywords: ``softmax_scale``; ``cp_group`` (None or size 1: no CP);
``cp_algo`` "allgather" (local queries, all heads) or "ulysses" (heads split
over the group); ``layout`` "zigzag" or "contiguous"; ``causal``;
``kernel`` "eager" | "sdpa" | "npu" | "auto" (npu on NPU tensors, else sdpa);
``check_ranks`` (default True): exchange shapes across the group first so a
mismatch raises on every rank instead of hanging.

Autograd is exact for all four inputs. The ``kv_up_weight`` gradient on each
rank is that rank's partial sum; Megatron reduces it over dp x cp.
"""
from __future__ import annotations

from typing import Optional

from . import validate
from .forms.absorbed import absorbed_forward
from .forms.explicit import explicit_forward
from .forms.laga import laga_forward


def _setup(query, kv_latent, k_pos_emb, kv_up_weight, softmax_scale, cp_group, cp_algo, layout,
           causal, kernel, check_ranks):
    return validate.check(query, kv_latent, k_pos_emb, kv_up_weight, softmax_scale=softmax_scale,
                          cp_group=cp_group, cp_algo=cp_algo, layout=layout, causal=causal,
                          kernel=kernel, check_ranks=check_ranks)


def laga_attention(query, kv_latent, k_pos_emb, kv_up_weight, *, softmax_scale, cp_group=None,
                   cp_algo="allgather", layout="zigzag", causal=True, kernel="auto",
                   check_ranks: bool = True, trim_causal_prefix: bool = False):
    """LAGA: gather the latent (d_c + d_r per token), rebuild K/V locally, attend.

    ``trim_causal_prefix``: rebuild only keys some local query can see.
    """
    setup = _setup(query, kv_latent, k_pos_emb, kv_up_weight, softmax_scale, cp_group, cp_algo,
                   layout, causal, kernel, check_ranks)
    return laga_forward(query, kv_latent, k_pos_emb, kv_up_weight, setup,
                        trim_causal_prefix=trim_causal_prefix)


def explicit_attention(query, kv_latent, k_pos_emb, kv_up_weight, *, softmax_scale,
                       cp_group=None, cp_algo="allgather", layout="zigzag", causal=True,
                       kernel="auto", check_ranks: bool = True):
    """Explicit MLA: per-head K/V (allgather) or Q/K/V/O (ulysses) cross the wire."""
    setup = _setup(query, kv_latent, k_pos_emb, kv_up_weight, softmax_scale, cp_group, cp_algo,
                   layout, causal, kernel, check_ranks)
    return explicit_forward(query, kv_latent, k_pos_emb, kv_up_weight, setup)


def absorbed_attention(query, kv_latent, k_pos_emb, kv_up_weight, *, softmax_scale,
                       cp_group=None, cp_algo="allgather", layout="zigzag", causal=True,
                       kernel="auto", check_ranks: bool = True):
    """Absorbed MLA: latent-space attention with q . W_UK and o . W_UV^T (the memory trap)."""
    setup = _setup(query, kv_latent, k_pos_emb, kv_up_weight, softmax_scale, cp_group, cp_algo,
                   layout, causal, kernel, check_ranks)
    return absorbed_forward(query, kv_latent, k_pos_emb, kv_up_weight, setup)


FORMS = {"explicit": explicit_attention, "absorbed": absorbed_attention, "laga": laga_attention}

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
``cp_algo`` "allgather" (local queries, all heads), "ulysses" (heads split
over the group) or "hybrid" (heads split inside ``ulysses_group``, the U
consecutive CP ranks holding this rank, CP rank c = r*U + u; the latent or
K/V cross the rest: docs/DESIGN.md "Hybrid CP"); ``ulysses_group``: hybrid
only; ``layout`` "zigzag" or "contiguous"; ``causal``;
``kernel`` "eager" | "sdpa" | "npu" | "auto" (npu on NPU tensors, else sdpa);
``cu_seqlens``: packed documents, the global boundaries 0 ... S (local
length x CP) in position order, the same on every rank (micro-batch 1): a
query sees only keys of its own document at positions <= its own (causal)
or its whole document (``causal=False``). ``layout="doc_zigzag"`` splits
every document into 2P chunks (rank r holds chunks r and 2P-1-r of each).
``qk_head_dim``/``v_head_dim``: the MLA config's head dims (the patches pass
them); without them the tensors must read unambiguously (d_n == d_v).
``check_ranks`` (default True): exchange every value that must agree across
the group first, so a rank that differs raises on every rank instead of
hanging; once every rank passes False in such an exchange the group skips
it (handshake.py, docs/DESIGN.md, section "Handshake").
``pad_v`` (default False): with kernel "npu", zero-pad V to the q/k head dim
for ``npu_fusion_attention`` and slice the output back (exact; what
MindSpeed-LLM does unless ``--mla-fa-without-pad``; unpadded V needs CANN
8.2.RC1 or newer), ignored by the other kernels.

Autograd is exact for all four inputs. The ``kv_up_weight`` gradient on each
rank is that rank's partial sum; Megatron reduces it over dp x cp.
"""
from __future__ import annotations

from typing import Optional

from . import checks
from .forms.absorbed import absorbed_forward
from .forms.explicit import explicit_forward
from .forms.laga import laga_forward


def _setup(form, query, kv_latent, k_pos_emb, kv_up_weight, softmax_scale, cp_group, cp_algo,
           layout, causal, kernel, check_ranks, qk_head_dim, v_head_dim, cu_seqlens, pad_v,
           blockwise=False, options=None, extra_check=None, ulysses_group=None):
    return checks.check(query, kv_latent, k_pos_emb, kv_up_weight, softmax_scale=softmax_scale,
                          cp_group=cp_group, cp_algo=cp_algo, layout=layout, causal=causal,
                          kernel=kernel, form=form, check_ranks=check_ranks, blockwise=blockwise,
                          qk_head_dim=qk_head_dim, v_head_dim=v_head_dim, options=options,
                          cu_seqlens=cu_seqlens, pad_v=pad_v, extra_check=extra_check,
                          ulysses_group=ulysses_group)


def _flag(value) -> int:
    """An option as the handshake's integer (-1 when it is not a valid value)."""
    return int(value) if isinstance(value, bool) else -1


def laga_attention(query, kv_latent, k_pos_emb, kv_up_weight, *, softmax_scale, cp_group=None,
                   cp_algo="allgather", layout="zigzag", causal=True, kernel="auto",
                   check_ranks: bool = True, trim_causal_prefix: bool = False,
                   recompute_kv: bool = False, kv_block_size: Optional[int] = None,
                   latent_gather=None, qk_head_dim: Optional[int] = None,
                   v_head_dim: Optional[int] = None, cu_seqlens=None, pad_v: bool = False,
                   ulysses_group=None):
    """LAGA: gather the latent (d_c + d_r per token), rebuild K/V locally, attend.

    Options beyond the paper (all exact; see docs/BEYOND.md):

    - ``trim_causal_prefix``: rebuild (and attend) only keys some local query
      can see under the causal mask.
    - ``recompute_kv``: keep only the gathered latent for backward and rebuild
      K/V there; attention runs blockwise with an online softmax
      (kernel 'eager', 'npu' or 'auto').
    - ``kv_block_size``: keys per rebuilt block (needs ``recompute_kv``); full
      sequence K/V then never exist at once. None: one block.
    - ``latent_gather``: the handle of ``start_latent_gather(kv_latent,
      k_pos_emb, cp_group=...)`` launched earlier, to overlap the gather with
      the query projection and its reduce-scatter with the dq work.
    """
    def check_options(cp_size):
        _check_laga_options(kv_latent, k_pos_emb, cp_group, cp_size, recompute_kv,
                            kv_block_size, trim_causal_prefix, latent_gather)

    options = {"recompute_kv": _flag(recompute_kv), "trim_causal_prefix": _flag(trim_causal_prefix),
               "kv_block_size": kv_block_size if isinstance(kv_block_size, int) else 0,
               "latent_gather": int(latent_gather is not None)}
    setup = _setup("laga", query, kv_latent, k_pos_emb, kv_up_weight, softmax_scale, cp_group,
                   cp_algo, layout, causal, kernel, check_ranks, qk_head_dim, v_head_dim,
                   cu_seqlens, pad_v, blockwise=recompute_kv is True, options=options,
                   extra_check=check_options, ulysses_group=ulysses_group)
    return laga_forward(query, kv_latent, k_pos_emb, kv_up_weight, setup,
                        trim_causal_prefix=trim_causal_prefix, recompute_kv=recompute_kv,
                        kv_block_size=kv_block_size, latent_gather=latent_gather)


def _check_laga_options(kv_latent, k_pos_emb, cp_group, cp_size, recompute_kv, kv_block_size,
                        trim_causal_prefix, latent_gather):
    for name, flag in (("recompute_kv", recompute_kv), ("trim_causal_prefix", trim_causal_prefix)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    if kv_block_size is not None:
        if isinstance(kv_block_size, bool) or not isinstance(kv_block_size, int) or kv_block_size <= 0:
            raise ValueError(f"kv_block_size must be a positive int or None, got {kv_block_size!r}")
        if not recompute_kv:
            raise ValueError("kv_block_size needs recompute_kv=True: blockwise rebuild keeps no "
                             "K/V for backward, so it rebuilds them there")
    if latent_gather is not None:
        from .overlap import LatentGather
        if not isinstance(latent_gather, LatentGather):
            raise ValueError("latent_gather must come from start_latent_gather(kv_latent, "
                             f"k_pos_emb, cp_group=...), got {type(latent_gather).__name__}")
        if latent_gather.kv_latent is not kv_latent or latent_gather.k_pos_emb is not k_pos_emb:
            raise ValueError("latent_gather was started on other kv_latent/k_pos_emb tensors than "
                             "the ones passed here; pass the same tensors to both calls")
        if latent_gather.cp_group is not cp_group or cp_size == 1:
            raise ValueError("latent_gather was started on another cp_group; pass the same group")


def explicit_attention(query, kv_latent, k_pos_emb, kv_up_weight, *, softmax_scale,
                       cp_group=None, cp_algo="allgather", layout="zigzag", causal=True,
                       kernel="auto", check_ranks: bool = True, qk_head_dim: Optional[int] = None,
                       v_head_dim: Optional[int] = None, cu_seqlens=None, pad_v: bool = False,
                       ulysses_group=None):
    """Explicit MLA: per-head K/V (allgather) or Q/K/V/O (ulysses) cross the wire."""
    setup = _setup("explicit", query, kv_latent, k_pos_emb, kv_up_weight, softmax_scale, cp_group,
                   cp_algo, layout, causal, kernel, check_ranks, qk_head_dim, v_head_dim,
                   cu_seqlens, pad_v, ulysses_group=ulysses_group)
    return explicit_forward(query, kv_latent, k_pos_emb, kv_up_weight, setup)


def absorbed_attention(query, kv_latent, k_pos_emb, kv_up_weight, *, softmax_scale,
                       cp_group=None, cp_algo="allgather", layout="zigzag", causal=True,
                       kernel="auto", check_ranks: bool = True, qk_head_dim: Optional[int] = None,
                       v_head_dim: Optional[int] = None, cu_seqlens=None, pad_v: bool = False,
                       ulysses_group=None):
    """Absorbed MLA: latent-space attention with q . W_UK and o . W_UV^T (the memory trap)."""
    setup = _setup("absorbed", query, kv_latent, k_pos_emb, kv_up_weight, softmax_scale, cp_group,
                   cp_algo, layout, causal, kernel, check_ranks, qk_head_dim, v_head_dim,
                   cu_seqlens, pad_v, ulysses_group=ulysses_group)
    return absorbed_forward(query, kv_latent, k_pos_emb, kv_up_weight, setup)


FORMS = {"explicit": explicit_attention, "absorbed": absorbed_attention, "laga": laga_attention}

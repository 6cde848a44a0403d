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
``key_padding_mask``: None, or a bool tensor [b, S] (S = local length x CP)
in global position order, True = a padding key, the same on every CP rank
(exchanged in the handshake), on the inputs' device: a query sees the keys
``causal`` lets it see, minus the padding keys (right or left padding, any
pattern, per sample). Only the latent crosses the wire as before; no dense
mask is passed or gathered. A query row that then sees no key at all (left
padding's pad rows, a sample of padding only) returns ``empty_rows``:
"mean" (default), the mean of the values of every position of its sequence,
what a softmax over a row masked with one finite value gives (Megatron's
unfused softmax, Hugging Face's eager attention, hence MindSpeed-LLM without
flash attention), or "zero" (flash kernels, torch SDPA); either way it passes
no gradient to the queries and keys. Not with ``cu_seqlens`` (refused by
name). None: the plain causal path, unchanged.
``qk_head_dim``/``v_head_dim``: the MLA config's head dims (the patches pass
them); without them the tensors must read unambiguously (d_n == d_v).
``check_ranks`` (default None: exchange unless the group skips): exchange
every value that must agree across the group first, so a rank that differs
raises on every rank instead of hanging; once every rank passes False in such
an exchange the group skips it, and an explicit True exchanges again (every
rank must pass True in that call; mindspeed_laga/agreement/, docs/DESIGN.md, section "Handshake").
``pad_v`` (default False): with kernel "npu", zero-pad V to the q/k head dim
for ``npu_fusion_attention`` and slice the output back (exact; what
MindSpeed-LLM does unless ``--mla-fa-without-pad``; unpadded V needs CANN
8.2.RC1 or newer), ignored by the other kernels.

Every CP rank must pass the same ``kv_up_weight`` (CP ranks are replicas of
one TP shard): a rank with other weights runs and returns wrong numbers on
every rank. The handshake does not compare weights per call;
``handshake.check_same_weight(kv_up_weight, cp_group)`` does (one exchange of
a checksum), and the adapters run it on a module's first call.

Under ``torch.autocast`` (CPU, CUDA, NPU) a form runs wholly in the autocast
dtype: the inputs autocast would cast (float32/16, bfloat16) are cast to it,
attention runs with autocast off, and the output comes back in that dtype
(float64 inputs stay float64, as autocast leaves them). ``start_latent_gather``
casts the same way, so its handle matches the call it feeds.

Autograd is exact for all four inputs. The ``kv_up_weight`` gradient on each
rank is that rank's partial sum; Megatron reduces it over dp x cp.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from . import checks
from .forms.absorbed import absorbed_forward
from .forms.explicit import explicit_forward
from .forms.laga import laga_forward
from .kernels.precision import autocast_dtype, to_autocast
from .options import AttnOptions


def _autocast(tensors, latent_gather=None):
    """(the tensors the form runs on, the context it runs in): under torch.autocast, cast to
    its dtype and autocast off inside (the forms pick their own precision); else as given.
    A latent_gather started on these tensors hands out the copies it gathered."""
    query = tensors[0]
    device = query.device.type if isinstance(query, torch.Tensor) else None
    dtype = autocast_dtype(device) if device else None
    if dtype is None:
        return list(tensors), contextlib.nullcontext()
    cast = to_autocast(tensors, dtype)
    if latent_gather is not None and hasattr(latent_gather, "started_on") \
            and latent_gather.started_on(tensors[1], tensors[2]):
        cast[1], cast[2] = latent_gather.kv_latent, latent_gather.k_pos_emb
    return cast, torch.autocast(device, enabled=False)


def _run(forward, tensors, options: AttnOptions, *form_options):
    """Check the call once (``checks.check``), then run the form on the checked setup (LAGA:
    and its one options record); under torch.autocast on the cast tensors with autocast
    off (:func:`_autocast`)."""
    tensors, region = _autocast(tensors, options.latent_gather)
    with region:
        return forward(*tensors, checks.check(*tensors, options), *form_options)


def laga_attention(query, kv_latent, k_pos_emb, kv_up_weight, *, softmax_scale, cp_group=None,
                   cp_algo="allgather", layout="zigzag", causal=True, kernel="auto",
                   check_ranks: Optional[bool] = None, trim_causal_prefix: bool = False,
                   recompute_kv: bool = False, kv_block_size: Optional[int] = None,
                   latent_gather=None, qk_head_dim: Optional[int] = None,
                   v_head_dim: Optional[int] = None, cu_seqlens=None, pad_v: bool = False,
                   ulysses_group=None, key_padding_mask=None, empty_rows: str = "mean",
                   kv_up_linear=None):
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
    - ``kv_up_linear``: the up-projection as a function ``(latent [S, b, d_c],
      weight_rows [r, d_c], first_row) -> [S, b, r]`` that autograd differentiates
      (e.g. the host module's own FP8 matmul), called where the rebuild calls
      ``F.linear``; ``weight_rows`` is ``kv_up_weight[first_row:first_row + r]``, the
      rows of this rank's heads. None: ``F.linear``. Not with ``recompute_kv``, nor with ``key_padding_mask`` and
      ``empty_rows="mean"`` (both use the weight as a matrix; refused by name).

    Every CP rank must pass the same ``kv_up_weight`` (module docstring).
    """
    options = AttnOptions.of("laga", locals())
    return _run(laga_forward, (query, kv_latent, k_pos_emb, kv_up_weight), options, options.laga)


def _dense_form(form: str, forward, doc: str):
    """``explicit_attention`` and ``absorbed_attention``: one signature (LAGA's without its
    options), the options record, then ``forward``."""

    def attention(query, kv_latent, k_pos_emb, kv_up_weight, *, softmax_scale,
                  cp_group=None, cp_algo="allgather", layout="zigzag", causal=True,
                  kernel="auto", check_ranks: Optional[bool] = None,
                  qk_head_dim: Optional[int] = None, v_head_dim: Optional[int] = None,
                  cu_seqlens=None, pad_v: bool = False,
                  ulysses_group=None, key_padding_mask=None, empty_rows: str = "mean"):
        options = AttnOptions.of(form, locals())
        return _run(forward, (query, kv_latent, k_pos_emb, kv_up_weight), options)

    attention.__name__ = attention.__qualname__ = f"{form}_attention"
    attention.__doc__ = doc
    return attention


explicit_attention = _dense_form(
    "explicit", explicit_forward,
    "Explicit MLA: per-head K/V (allgather) or Q/K/V/O (ulysses) cross the wire.")
absorbed_attention = _dense_form(
    "absorbed", absorbed_forward,
    "Absorbed MLA: latent-space attention with q . W_UK and o . W_UV^T (the memory trap).")


FORMS = {"explicit": explicit_attention, "absorbed": absorbed_attention, "laga": laga_attention}

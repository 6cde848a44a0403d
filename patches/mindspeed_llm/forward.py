"""LAGA inside MindSpeed-LLM's ``CustomMLASelfAttention.forward``.

``LAGAFeature`` registers :func:`laga_mla_forward_wrapper` on MindSpeed's
patch manager; its name ends in ``wrapper``, so MindSpeed stacks it around the
forward (and around any other feature's patch of it) instead of replacing it.

In training with CP > 1 the wrapped forward computes the query, the kv latent
and the rope key with the module's own submodules, exactly as the original's
up-projection does, applies rope (``rotary_pos_emb`` is already sliced to this
rank's global positions), hands them to :func:`mindspeed_laga.laga_attention`
and finishes with ``linear_proj``. Anything else (evaluation, inference,
CP size 1) runs the original forward untouched.

With ``--reset-attention-mask`` the document boundaries are read where
MindSpeed's CP attention reads them (``get_actual_seq_len``) and rope is
applied exactly as the original applies it (with ``packed_seq_params`` as its
``cu_seqlens``, the table MindSpeed-LLM builds from the reset position ids).
With ``hybrid_cp_algo`` the heads split inside MindSpeed's hybrid Ulysses group.

The forward copied here is MindSpeed-LLM's, one for every release in
``host.SUPPORTED_MINDSPEED_LLM``; what differs between releases (the
latent scales, rope dims de-interleaved for yarn/plm on 2.2.0/2.3.0) is a field
of the release found in the wrapped forward's own module
(patches/mindspeed_llm/releases.py). An untested host fails with the tested
releases named when the patch is applied or on a module's first LAGA call.
"""
from __future__ import annotations

import functools
import inspect
import math
from typing import NamedTuple, Optional

import torch

from mindspeed_laga.api import laga_attention
from mindspeed_laga.cp_algos import algo
from mindspeed_laga.features.laga_args import laga_settings
from mindspeed_laga.features.laga_checks import padded_length_error, sequence_multiple

from ..attention_mask import key_padding_from_mask
from mindspeed_laga import agreement

from ..common import agree_per_micro_batch, check_weight_once, start_gather
from ..lora import effective_weight
from .dsa import dsa_rope, is_dsa, laga_dsa_attention
from .fb_overlap import hook_a2a, launch_a2a
from .fp8 import kv_up_linear
from .host import check_mindspeed_llm_forward, check_mindspeed_llm_module, release_of_module
from .releases import deinterleave_rope_dims

# forward arguments that only non-training or packed paths pass; any of them -> original
_ORIGINAL_ONLY = ("key_value_states", "inference_context", "inference_params", "rotary_pos_cos",
                  "rotary_pos_sin", "attention_bias", "packed_seq_params", "sequence_len_offset")
# ...except packed_seq_params under --reset-attention-mask: MindSpeed-LLM's GPT forward
# then carries the same document boundaries in it (and the rope position ids)
_DOCUMENT_ARGS = ("packed_seq_params",)


def laga_mla_forward_wrapper(forward, release=None):
    """Wrap ``CustomMLASelfAttention.forward``: LAGA where it applies, else ``forward``.

    ``release`` (a ``releases.Release``): the MindSpeed-LLM release whose
    forward this is; by default read from the module defining ``forward``."""
    release = release or check_mindspeed_llm_forward(forward)
    signature = inspect.signature(forward)

    @functools.wraps(forward)
    def forward_with_laga(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs).arguments
        megatron_args = _megatron_args()
        cp_group = _laga_cp_group(self, call, megatron_args)
        if cp_group is None:
            return forward(self, *args, **kwargs)
        return laga_self_attention(self, call["hidden_states"], call.get("rotary_pos_emb"),
                                   cp_group, megatron_args,
                                   packed_seq_params=call.get("packed_seq_params"),
                                   release=release, attention_mask=call.get("attention_mask"))

    return forward_with_laga


def _megatron_args():
    from megatron.training import get_args
    return get_args()


def _laga_cp_group(self, call, megatron_args):
    """The CP group when LAGA runs this call, else None."""
    if not getattr(megatron_args, "mla_latent_all_gather", False) or not self.training:
        return None
    allowed = _DOCUMENT_ARGS if getattr(megatron_args, "reset_attention_mask", False) else ()
    if any(call.get(name) is not None for name in _ORIGINAL_ONLY if name not in allowed):
        return None
    # not self.config: MindSpeed's CP attention sets config.context_parallel_size = 1 while it is built (docs/HOSTS.md, section "MindSpeed's CP algorithms")
    from megatron.core import parallel_state
    if parallel_state.get_context_parallel_world_size() == 1:
        return None
    return parallel_state.get_context_parallel_group()


def laga_self_attention(self, hidden_states, rotary_pos_emb, cp_group, megatron_args,
                        packed_seq_params=None, release=None, attention_mask=None):
    """MLA self-attention with LAGA as the core; returns ``linear_proj``'s (output, bias).

    ``release``: the MindSpeed-LLM release of ``self``'s class (by default read from
    the module defining the class). ``attention_mask``: the host's, as the layer got it
    (the SFT trainer's causal + key padding mask, whole under every mapped algorithm;
    patches/attention_mask.py turns it into the core's key padding or refuses it)."""
    release = release or release_of_module(self)
    check_mindspeed_llm_module(self, release)
    if is_dsa(self):  # sparse MLA: one gather of latent, rope key and index key (dsa.py)
        return _dsa_attention(self, hidden_states, rotary_pos_emb, cp_group, megatron_args,
                              release, carriers=(packed_seq_params, attention_mask))
    settings = laga_settings(megatron_args)
    check_ranks = agree_per_micro_batch(self, cp_group)
    # (a LoRA-wrapped module it cannot read raises here, on every CP rank on the first call)
    kv_up_weight = check_weight_once(check_ranks, lambda: _kv_up_weight(self), cp_group)
    key_padding = None
    if not settings.documents:  # packed documents: the boundaries carry the mask
        key_padding = key_padding_from_mask(
            attention_mask, _full_length(self, hidden_states, cp_group), hidden_states.shape[1],
            cp_group, _length_error(settings, megatron_args, cp_group))
    overlap = settings.overlap and torch.distributed.get_world_size(cp_group) > 1
    up_linear = kv_up_linear(self)  # the module's FP8 matmul, or None
    if up_linear is not None and key_padding is not None:  # alike on every rank: no collective yet
        raise ValueError("--mla-latent-all-gather with --fp8-format and a padded batch (the SFT "
                         "key-padding mask) is not supported: a query that sees no key gets the "
                         "mean of the values, which LAGA builds from the mean latent, not through "
                         "the FP8 up-projection. Pack the samples (--reset-attention-mask) or "
                         "drop --fp8-format")
    rope_input = _rope_input(release, megatron_args)
    inputs = _mla_inputs(self, hidden_states, rotary_pos_emb, cp_group if overlap else None,
                         check_ranks, rope_cu_seqlens=packed_seq_params, rope_input=rope_input,
                         lora_scales=release.lora_scales)
    cu_seqlens = _cu_seqlens(self, settings, cp_group)
    launch_a2a(self)
    core_out = laga_attention(inputs.query, inputs.kv_latent, inputs.k_pos_emb, kv_up_weight,
                              softmax_scale=softmax_scale(self, megatron_args), cp_group=cp_group,
                              check_ranks=check_ranks, latent_gather=inputs.gather,
                              qk_head_dim=self.qk_head_dim, v_head_dim=self.v_head_dim,
                              cu_seqlens=cu_seqlens, ulysses_group=_ulysses_group(settings),
                              key_padding_mask=key_padding,
                              kv_up_linear=up_linear,
                              **settings.core_options())  # pad_v = not --mla-fa-without-pad
    hook_a2a(self, core_out)
    return self.linear_proj(core_out)


def _dsa_attention(self, hidden_states, rotary_pos_emb, cp_group, megatron_args, release,
                   carriers=(None, None)):
    """The DSA path, one way: MindSpeed-LLM's inputs built here (this adapter's query /
    latent / rope-key builder with the host's DSA rope), then patches/mindspeed_llm/dsa.py
    runs LAGA's sparse call and the host's loss bookkeeping. The host's DSA forward
    ignores the layer's attention mask (its picks are causal by position), and so does
    this path; under --reset-attention-mask the document boundaries are the dense path's
    (:func:`document_boundaries`), and rope gets ``packed_seq_params`` as the host's.
    ``carriers`` (packed_seq_params, attention_mask): the layer call's, which also carry
    the host's holder of shared picks."""
    packed_seq_params = carriers[0]
    check_ranks = agree_per_micro_batch(self, cp_group)
    kv_up_weight = check_weight_once(check_ranks, lambda: _kv_up_weight(self), cp_group)
    inputs = _mla_inputs(self, hidden_states, rotary_pos_emb, None, check_ranks,
                         rope_cu_seqlens=packed_seq_params,
                         rope_input=_rope_input(release, megatron_args),
                         lora_scales=release.lora_scales, rope=dsa_rope(self, megatron_args))
    cu_seqlens = _cu_seqlens(self, laga_settings(megatron_args), cp_group)
    return laga_dsa_attention(self, hidden_states, rotary_pos_emb, cp_group, megatron_args,
                              inputs, kv_up_weight, softmax_scale(self, megatron_args),
                              check_ranks, carriers, cu_seqlens=cu_seqlens)


def _full_length(self, hidden_states, cp_group) -> int:
    """The full sequence length: this rank's tokens (x TP under sequence parallelism) x CP."""
    s = hidden_states.shape[0]
    if self.config.sequence_parallel:
        from megatron.core import parallel_state
        s *= parallel_state.get_tensor_model_parallel_world_size()
    return s * torch.distributed.get_world_size(cp_group)


def _length_error(settings, megatron_args, cp_group):
    """length -> the message for a padded batch length the CP split cannot take, or None."""
    cp_size = torch.distributed.get_world_size(cp_group)
    multiple = sequence_multiple(megatron_args, cp_size, settings.cp_algo, settings.layout)
    flag = "--pad-to-multiple-of " + str(getattr(megatron_args, "pad_to_multiple_of", None))
    return lambda length: (padded_length_error(length, multiple, flag) if length % multiple
                           else None)


def _cu_seqlens(self, settings, cp_group):
    """The core's ``cu_seqlens``: this module's document boundaries under
    --reset-attention-mask (:func:`document_boundaries`), else None."""
    if not settings.documents:
        return None
    return document_boundaries(_mtp_depth(self), settings.loader_scaled_ends, cp_group)


def document_boundaries(mtp_depth: int = 0, loader_scaled: bool = True, cp_group=None):
    """--reset-attention-mask: the global document boundaries [0, end_1, ..., S].

    MindSpeed keeps the cumulative ends (no leading 0) in ``get_actual_seq_len``;
    under causal masks (``loader_scaled``) for megatron_cp_algo its loader padded
    every document to a multiple of 2*CP and divided the ends by the ring degree
    (CP), for ulysses and kvallgather the ring degree is 1. Under
    --attention-mask-type general the loader keeps the ends as they are (from the
    data's EOD, or every --fix-sub-seq-length tokens) for every algorithm. With --mtp-num-layers MindSpeed-LLM keeps
    one row of ends per depth (row 0: the main model, row d: the d-th MTP layer,
    whose rolled tokens end each document d earlier); ``mtp_depth`` picks the row,
    as the host's own core attention does with its ``mtp_idx``. A sample that ends
    on an EOD repeats the last end (an empty document): it holds no token, so it
    is dropped. A tensor of ends is read from the device once per micro-batch
    (``agreement.memo``: the layers of one forward share MindSpeed's one tensor).
    """
    from mindspeed.core.context_parallel.get_batch_utils import get_actual_seq_len, get_ring_degree

    ends = get_actual_seq_len()
    if ends is None:
        raise ValueError("--reset-attention-mask is set but MindSpeed holds no document "
                         "boundaries (get_actual_seq_len() is None): feed batches through "
                         "MindSpeed's get_batch, or drop --reset-attention-mask")
    scale = get_ring_degree() if loader_scaled else 1
    if isinstance(ends, torch.Tensor):  # every depth's row read at once, once per micro-batch
        key = ("actual_seq_len",) + agreement.tensor_key(ends)
        ends = agreement.memo(cp_group, key, lambda: ends.double().tolist())
    return _boundaries(ends, mtp_depth, scale)


def _boundaries(ends, mtp_depth: int, scale: int):
    """Host lists (one row, or one per MTP depth) -> the boundaries of ``mtp_depth``."""
    rows = ends if ends and isinstance(ends[0], (list, tuple)) else [ends]
    row = rows[mtp_depth] if len(rows) > 1 else rows[0]
    boundaries = [0]
    for end in row:
        end = int(round(float(end) * scale))
        if end != boundaries[-1]:
            boundaries.append(end)
    return boundaries


def _mtp_depth(self) -> int:
    """Which MTP depth this attention serves: MindSpeed-LLM sets ``mtp_idx`` on the
    attention module or on its core attention (0 in the main model); absent without MTP."""
    for module in (self, getattr(self, "core_attention", None)):
        if module is not None and getattr(module, "mtp_idx", None) is not None:
            return int(module.mtp_idx)
    return 0


def _ulysses_group(settings):
    """hybrid_cp_algo: MindSpeed's Ulysses sub-group of the CP group holding this rank."""
    if not algo(settings.cp_algo).takes_ulysses_degree:
        return None
    from mindspeed.core.context_parallel.model_parallel_utils import (
        get_context_parallel_group_for_hybrid_ulysses)
    return get_context_parallel_group_for_hybrid_ulysses()


def _rope(self):
    """The apply_rotary_pos_emb the original forward calls (its module's, patches included)."""
    import sys

    from megatron.core.models.common.embeddings.rotary_pos_embedding import apply_rotary_pos_emb
    return getattr(sys.modules.get(type(self).__module__), "apply_rotary_pos_emb",
                   apply_rotary_pos_emb)


def _rope_input(release, megatron_args):
    """What the release's forward does to q_pos_emb / k_pos_emb right before rope."""
    if release.deinterleaves(getattr(megatron_args, "rope_scaling_type", None)):
        return deinterleave_rope_dims
    return None


class MlaInputs(NamedTuple):
    """What the module's own submodules build from this rank's tokens."""
    query: torch.Tensor      # [s, b, n, d_n + d_r], rope applied
    kv_latent: torch.Tensor  # [s, b, d_c]
    k_pos_emb: torch.Tensor  # [s, b, d_r], rope applied
    gather: object           # the latent all-gather started early, or None
    q_compressed: torch.Tensor       # linear_qkv's query latent, before its layernorm
    q_normed: Optional[torch.Tensor]  # after it (None without a q_lora_rank)


def _mla_inputs(self, hidden_states, rotary_pos_emb, overlap_group=None, check_ranks=True,
                rope_cu_seqlens=None, rope_input=None, lora_scales=True, rope=None) -> MlaInputs:
    """query [s,b,n,d_n+d_r], kv_latent [s,b,d_c], k_pos_emb [s,b,d_r] as the original builds
    them, the latent all-gather already started when ``overlap_group`` is given, and the
    query latents the DSA indexer reads (:class:`MlaInputs`).

    ``rope_cu_seqlens``: what the original passes to rope as ``cu_seqlens``
    (``packed_seq_params`` under --reset-attention-mask, else None). ``rope_input``:
    applied to q_pos_emb and k_pos_emb before rope, as the release's forward does (None:
    nothing). ``lora_scales``: whether the release scales the q/kv latents. ``rope``: the
    rope to apply (None: the module's apply_rotary_pos_emb).

    s is this CP rank's tokens, gathered over TP under sequence parallelism. The
    latent is finished first so its gather overlaps the query projection.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_sequence_parallel_region)

    sequence_parallel = self.config.sequence_parallel
    s, b, _ = hidden_states.shape
    if sequence_parallel:
        s *= parallel_state.get_tensor_model_parallel_world_size()
    n = self.num_attention_heads_per_partition
    q_compressed, kv_compressed, k_pos_emb = torch.split(
        self.linear_qkv(hidden_states), [self.q_rank, self.kv_lora_rank, self.qk_pos_emb_head_dim],
        dim=-1)

    kv_latent = self.kv_layernorm(kv_compressed)
    if lora_scales and self.mla_scale_kv_lora is not None:
        kv_latent = kv_latent * self.mla_scale_kv_lora
    # what linear_kv_up_proj (column-parallel) does to its input: gather the
    # sequence under SP, else all-reduce the latent's grad over TP in backward
    if sequence_parallel:
        kv_latent = gather_from_sequence_parallel_region(kv_latent)
        k_pos_emb = gather_from_sequence_parallel_region(k_pos_emb)
    elif parallel_state.get_tensor_model_parallel_world_size() > 1:
        # (the core hands the latent's grad back contiguous, which this region's
        # TP all-reduce needs: see mindspeed_laga.forms.common.concat_latent)
        kv_latent = copy_to_tensor_model_parallel_region(kv_latent)
    apply_rotary_pos_emb = rope or _rope(self)
    k_pos_emb = k_pos_emb.view(s, b, 1, self.qk_pos_emb_head_dim)
    if rotary_pos_emb is not None and not isinstance(rotary_pos_emb, tuple):
        rotary_pos_emb = (rotary_pos_emb,) * 2
    if rotary_pos_emb is not None:
        k_pos_emb = rope_input(k_pos_emb) if rope_input else k_pos_emb
        k_pos_emb = apply_rotary_pos_emb(k_pos_emb, rotary_pos_emb[1], config=self.config,
                                         cu_seqlens=rope_cu_seqlens)
    k_pos_emb = k_pos_emb.reshape(s, b, self.qk_pos_emb_head_dim)
    gather = start_gather(overlap_group is not None, kv_latent, k_pos_emb, overlap_group,
                          check_ranks)

    q_no_pe, q_pos_emb, q_normed = _query_parts(self, q_compressed, s, b, n, lora_scales)
    if rotary_pos_emb is not None:
        q_pos_emb = rope_input(q_pos_emb) if rope_input else q_pos_emb
        q_pos_emb = apply_rotary_pos_emb(q_pos_emb, rotary_pos_emb[0], config=self.config,
                                         cu_seqlens=rope_cu_seqlens)
    query = torch.cat([q_no_pe, q_pos_emb], dim=-1)
    return MlaInputs(query, kv_latent, k_pos_emb, gather, q_compressed, q_normed)


def _query_parts(self, q_compressed, s, b, n, lora_scales=True):
    """(q_no_pe, q_pos_emb), each [s, b, n, *], for q_lora_rank set or not, fused or mm-split,
    and the query latent after its layernorm (None without a q_lora_rank)."""
    if self.q_layernorm is None:  # no q_lora_rank: linear_qkv already produced the query
        q = q_compressed.view(s, b, n, -1)
        return (*torch.split(q, [self.qk_head_dim, self.qk_pos_emb_head_dim], dim=-1), None)
    q_normed = self.q_layernorm(q_compressed)
    q_compressed = q_normed
    if lora_scales and self.mla_scale_q_lora is not None:
        q_compressed = q_compressed * self.mla_scale_q_lora
    if self.mla_mm_split:
        q_no_pe, _ = self.linear_qk_nope(q_compressed)
        q_pos_emb, _ = self.linear_qk_rope(q_compressed)
        return q_no_pe.view(s, b, n, -1), q_pos_emb.view(s, b, n, -1), q_normed
    q, _ = self.linear_q_up_proj(q_compressed)
    q = q.view(s, b, n, -1)
    return (*torch.split(q, [self.qk_head_dim, self.qk_pos_emb_head_dim], dim=-1), q_normed)


def _kv_up_weight(self):
    """[n*(d_n+d_v), d_c]: per head, its d_n key rows then its d_v value rows.

    With ``--mla-mm-split`` the two halves live in linear_kv_nope and linear_v;
    interleaving them per head is differentiable, so both weights get grads. A module
    wrapped by LoRA (``--lora-target-modules``) contributes the weight its forward
    applies, base plus delta (patches/lora.py), so its adapter trains as without LAGA.
    """
    if not self.mla_mm_split:
        return effective_weight(self.linear_kv_up_proj, "linear_kv_up_proj")
    n = self.num_attention_heads_per_partition
    key_rows = effective_weight(self.linear_kv_nope, "linear_kv_nope").reshape(
        n, self.qk_head_dim, self.kv_lora_rank)
    value_rows = effective_weight(self.linear_v, "linear_v").reshape(
        n, self.v_head_dim, self.kv_lora_rank)
    return torch.cat([key_rows, value_rows], dim=1).view(-1, self.kv_lora_rank)


def softmax_scale(self, megatron_args) -> float:
    """MindSpeed-LLM's MLA scale: 1/sqrt(q_head_dim), times yarn's mscale^2."""
    scale = self.q_head_dim ** -0.5
    mscale_all_dim = getattr(megatron_args, "rope_scaling_mscale_all_dim", None)
    if getattr(megatron_args, "rope_scaling_type", None) is not None and mscale_all_dim:
        factor = megatron_args.rope_scaling_factor
        mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale

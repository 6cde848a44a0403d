"""LAGA's dense form for transformers' ``DeepseekV3Attention`` on the FSDP2 backend.

Replaces the module's ``forward`` through the host's CP table (register.py) when the key
is on and CP > 1. The module's own projections and norms make the query, the latent
(after ``kv_a_layernorm``) and the rope key; rope is the module's own function applied
with the ``position_embeddings`` the model computed from the host's CP-sliced
``position_ids``, so every token is rotated at its global position. Then
``laga_attention`` gathers ``[latent | rope key]`` over the backend's CP group
(host.cp_group), rebuilds per-head K/V with ``kv_b_proj.weight`` and attends; the
module's ``o_proj`` follows. The host's CP types map to LAGA's algorithms by the split
the host's trainer gives each rank (host.CP_TYPES): ``ulysses`` (contiguous
slices, heads split) -> ``ulysses``; ``ring`` (chunks r and 2P-1-r) -> ``allgather``
with the ``zigzag`` layout.

Calls LAGA does not compute raise on every CP rank before any collective: a KV cache in use,
packed documents (``actual_seq_len``/``cu_seq_lens_*``), attention dropout in training.
Under FSDP2 the layer's parameters are unsharded for its forward, so ``kv_b_proj.weight``
is the full weight on every CP rank (checked once per module: check_weight_once).
"""
from __future__ import annotations

import sys

import torch

from mindspeed_laga import laga_attention

from ..common import agree_per_micro_batch, check_weight_once
from . import host

PACKED_KEYS = ("actual_seq_len", "cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens")


def _refuse(module, what: str, fix: str):
    raise ValueError(f"{host.KEY}: {type(module).__name__} (layer {module.layer_idx}): "
                     f"{what}; {fix}")


def _check_call(module, past_key_values, kwargs):
    # transformers hands every training forward an empty cache (use_cache defaults to
    # true); nothing reads it back in training, so only a cache in use is refused
    if past_key_values is not None and (
            not module.training or not hasattr(past_key_values, "get_seq_length")
            or past_key_values.get_seq_length(module.layer_idx)):
        _refuse(module, "a KV cache in use (generation) is not a CP training call",
                "drop the key for inference")
    packed = [k for k in PACKED_KEYS if kwargs.get(k) is not None]
    if packed:
        _refuse(module, f"packed documents ({packed[0]}) are not covered by the dense form here",
                "set data.reset_attention_mask false or drop the key")
    if module.training and module.attention_dropout:
        _refuse(module, f"attention_dropout={module.attention_dropout} is not computed by LAGA",
                "set attention_dropout 0 in config.json or drop the key")


def _rope(module):
    """The module's own rotary function (interleaved or not, as its config says)."""
    modeling = sys.modules[type(module).__module__]
    if module.config.rope_interleave:
        return modeling.apply_rotary_pos_emb_interleave
    return modeling.apply_rotary_pos_emb


def _query_latent_rope(module, hidden_states, position_embeddings):
    """query [s, b, n, d_n + d_r], kv_latent [s, b, d_c], k_pos_emb [s, b, d_r], as
    laga_attention takes them, from the module's own layers (hidden [b, s, h])."""
    b, s = hidden_states.shape[:2]
    if module.q_lora_rank is None:
        q_states = module.q_proj(hidden_states)
    else:
        q_states = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
    q_states = q_states.view(b, s, -1, module.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [module.qk_nope_head_dim, module.qk_rope_head_dim], -1)
    compressed_kv = module.kv_a_proj_with_mqa(hidden_states)
    kv_latent, k_rot = torch.split(compressed_kv, [module.kv_lora_rank, module.qk_rope_head_dim],
                                   -1)
    kv_latent = module.kv_a_layernorm(kv_latent)
    cos, sin = position_embeddings
    q_rot, k_rot = _rope(module)(q_rot, k_rot.view(b, 1, s, module.qk_rope_head_dim), cos, sin)
    query = torch.cat((q_pass, q_rot), dim=-1).permute(2, 0, 1, 3)      # [s, b, n, d]
    return query, kv_latent.transpose(0, 1), k_rot[:, 0].transpose(0, 1)


def laga_forward(self, hidden_states, position_embeddings, attention_mask,
                 past_key_values=None, cache_position=None, **kwargs):
    """``DeepseekV3Attention.forward`` under the backend's CP with LAGA (module docstring);
    the host's causal mask (``attention_mask``, built for local positions) is not read:
    LAGA masks causally by global position."""
    _check_call(self, past_key_values, kwargs)
    cp_group = host.cp_group()
    cp_algo, layout = host.cp_algo(host.cp_type())
    check_ranks = agree_per_micro_batch(self, cp_group)
    kv_up_weight = check_weight_once(bool(check_ranks), lambda: self.kv_b_proj.weight, cp_group,
                                     {"parallel.cp_type": (cp_algo, host.LAGA_ALGOS)})
    query, kv_latent, k_pos_emb = _query_latent_rope(self, hidden_states, position_embeddings)
    out = laga_attention(query, kv_latent, k_pos_emb, kv_up_weight, softmax_scale=self.scaling,
                         cp_group=cp_group, cp_algo=cp_algo, layout=layout, causal=True,
                         qk_head_dim=self.qk_nope_head_dim, v_head_dim=self.v_head_dim,
                         check_ranks=check_ranks)
    b = hidden_states.shape[0]
    return self.o_proj(out.transpose(0, 1).reshape(b, -1, out.shape[-1]).contiguous()), None

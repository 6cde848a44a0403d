"""A CPU stand-in for MindSpeed-LLM's ``CustomMLASelfAttention`` (TP = 1, no SP).

Same submodule names, constructor rules and forward math as the real class
(mindspeed_llm/tasks/models/transformer/multi_latent_attention.py, naive MLA
path): ``linear_qkv`` (returns a tensor, like ``LinearNoTP``) -> split into
q_compressed / kv_compressed / k_pos_emb -> ``q_layernorm`` (+ q-lora scale) ->
``linear_q_up_proj`` or ``linear_qk_nope`` + ``linear_qk_rope`` (``--mla-mm-split``)
-> ``kv_layernorm`` (+ kv-lora scale) -> ``linear_kv_up_proj`` or ``linear_kv_nope``
+ ``linear_v`` -> rope on q_pe and k_pe with Megatron's ``apply_rotary_pos_emb``
-> k_pe expanded to every head -> ``core_attention`` -> ``linear_proj``.
Options read from ``get_args()`` in ``__init__`` as the real class does.
``core_attention`` is causal attention over the whole local sequence with
``MlaDotProductAttention``'s scale (1/sqrt(q_head_dim), times yarn's mscale^2):
the real class's math at CP = 1.

Written for the tests from a reading of the real class; no upstream code.
"""
from __future__ import annotations

import math
import sys
import types
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def forward_backward(module, forward, hidden, rope, grad_out) -> dict:
    """``forward(hidden, rope)`` and backward of ``(output * grad_out).sum()``:
    the output, the hidden-states grad and every parameter grad (shared by the
    stand-in and the real-class tests)."""
    module.zero_grad(set_to_none=True)
    hidden = hidden.detach().clone().requires_grad_()
    output, bias = forward(hidden, rope)
    assert bias is None
    (output * grad_out).sum().backward()
    return dict(output=output.detach(), hidden_grad=hidden.grad,
                param_grads={n: p.grad.clone() for n, p in module.named_parameters()
                             if p.grad is not None})


def install_megatron_args(args) -> None:
    """``megatron.training.get_args()`` returning ``args``.

    megatron-core ships no ``megatron.training``; the real class reads its options there."""
    module = types.ModuleType("megatron.training")
    module.get_args = lambda: args
    sys.modules["megatron.training"] = module


def _get_args():
    from megatron.training import get_args
    return get_args()


class ParallelLinear(nn.Module):
    """Column/RowParallelLinear at TP = 1: returns (output, bias)."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) / math.sqrt(in_features))

    def forward(self, x):
        return F.linear(x, self.weight), None


class LinearNoTP(nn.Module):
    """MindSpeed-LLM's replicated linear: returns the output tensor only."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) / math.sqrt(in_features))

    def forward(self, x):
        return torch.matmul(x, self.weight.t())


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(hidden_size))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class IdentityOp(nn.Module):
    def forward(self, x):
        return x


def yarn_mscale(scale, mscale):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class CausalCoreAttention(nn.Module):
    """MlaDotProductAttention's math at CP = 1: causal softmax(q.k * scale) . v."""

    def __init__(self, args):
        super().__init__()
        self.softmax_scale = (args.qk_head_dim + args.qk_pos_emb_head_dim) ** -0.5
        mscale_all_dim = args.rope_scaling_mscale_all_dim or 0
        if args.rope_scaling_type is not None and mscale_all_dim:
            m = yarn_mscale(args.rope_scaling_factor, mscale_all_dim)
            self.softmax_scale *= m * m

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                packed_seq_params=None, **_):
        s, b, n, _ = query.shape
        scores = torch.einsum("sbnd,tbnd->bnst", query, key) * self.softmax_scale
        future = torch.ones(s, s, dtype=torch.bool, device=query.device).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return torch.einsum("bnst,tbnv->sbnv", probs, value).reshape(s, b, -1)


class StandinMLASelfAttention(nn.Module):
    """CustomMLASelfAttention's structure and forward math on CPU."""

    def __init__(self, config):
        super().__init__()
        args = _get_args()
        self.config = config
        self.num_attention_heads_per_partition = config.num_attention_heads
        self.qk_head_dim = config.qk_head_dim
        self.qk_pos_emb_head_dim = config.qk_pos_emb_head_dim
        self.v_head_dim = config.v_head_dim
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.q_head_dim = self.qk_head_dim + self.qk_pos_emb_head_dim
        self.mla_mm_split = args.mla_mm_split
        self.mla_scale_q_lora = ((config.hidden_size / self.q_lora_rank) ** 0.5
                                 if args.enable_mla_scale_q_lora else None)
        self.mla_scale_kv_lora = ((config.hidden_size / self.kv_lora_rank) ** 0.5
                                  if args.enable_mla_scale_kv_lora else None)
        self.a2a_hooked_on_attention = False
        self.original_calls = 0
        n = config.num_attention_heads
        norm = RMSNorm if args.qk_layernorm else (lambda _size: IdentityOp())

        if self.q_lora_rank is None:
            self.q_rank = n * self.q_head_dim
            self.q_layernorm = None
        else:
            self.q_rank = self.q_lora_rank
            self.q_layernorm = norm(self.q_lora_rank)
            if not self.mla_mm_split:
                self.linear_q_up_proj = ParallelLinear(self.q_lora_rank, n * self.q_head_dim)
            else:
                self.linear_qk_nope = ParallelLinear(self.q_lora_rank, n * self.qk_head_dim)
                self.linear_qk_rope = ParallelLinear(self.q_lora_rank, n * self.qk_pos_emb_head_dim)
        self.linear_qkv = LinearNoTP(config.hidden_size,
                                     self.q_rank + self.kv_lora_rank + self.qk_pos_emb_head_dim)
        self.kv_layernorm = norm(self.kv_lora_rank)
        if not self.mla_mm_split:
            self.linear_kv_up_proj = ParallelLinear(self.kv_lora_rank,
                                                    n * (self.qk_head_dim + self.v_head_dim))
        else:
            self.linear_kv_nope = ParallelLinear(self.kv_lora_rank, n * self.qk_head_dim)
            self.linear_v = ParallelLinear(self.kv_lora_rank, n * self.v_head_dim)
        self.core_attention = CausalCoreAttention(args)
        self.linear_proj = ParallelLinear(n * self.v_head_dim, config.hidden_size)

    def forward(self, hidden_states, attention_mask, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, attention_bias=None, packed_seq_params=None,
                sequence_len_offset=None, *, inference_params=None):
        from megatron.core.models.common.embeddings.rotary_pos_embedding import (
            apply_rotary_pos_emb)
        self.original_calls += 1
        if rotary_pos_emb is not None and not isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = (rotary_pos_emb,) * 2
        q_len, bsz, _ = hidden_states.shape
        n = self.num_attention_heads_per_partition
        q_compressed, kv_compressed, k_pos_emb = torch.split(
            self.linear_qkv(hidden_states),
            [self.q_rank, self.kv_lora_rank, self.qk_pos_emb_head_dim], dim=-1)
        if self.q_layernorm is not None:
            q_compressed = self.q_layernorm(q_compressed)
            if self.mla_scale_q_lora is not None:
                q_compressed = q_compressed * self.mla_scale_q_lora
            if not self.mla_mm_split:
                q, _ = self.linear_q_up_proj(q_compressed)
                q = q.view(q_len, bsz, n, -1)
                q_no_pe, q_pos_emb = torch.split(
                    q, [self.qk_head_dim, self.qk_pos_emb_head_dim], -1)
            else:
                q_no_pe = self.linear_qk_nope(q_compressed)[0].view(q_len, bsz, n, -1)
                q_pos_emb = self.linear_qk_rope(q_compressed)[0].view(q_len, bsz, n, -1)
        else:
            q = q_compressed.view(q_len, bsz, n, -1)
            q_no_pe, q_pos_emb = torch.split(q, [self.qk_head_dim, self.qk_pos_emb_head_dim], -1)
        k_pos_emb = k_pos_emb.view(q_len, bsz, 1, self.qk_pos_emb_head_dim)
        kv_norm = self.kv_layernorm(kv_compressed)
        if self.mla_scale_kv_lora is not None:
            kv_norm = kv_norm * self.mla_scale_kv_lora
        if not self.mla_mm_split:
            kv, _ = self.linear_kv_up_proj(kv_norm)
            kv = kv.view(q_len, bsz, n, self.qk_head_dim + self.v_head_dim)
            k_no_pe, value = torch.split(kv, [self.qk_head_dim, self.v_head_dim], dim=-1)
        else:
            k_no_pe = self.linear_kv_nope(kv_norm)[0].view(q_len, bsz, n, -1)
            value = self.linear_v(kv_norm)[0].view(q_len, bsz, n, -1)
        if rotary_pos_emb is not None:
            q_pos_emb = apply_rotary_pos_emb(q_pos_emb, rotary_pos_emb[0], config=self.config,
                                             cu_seqlens=None)
            k_pos_emb = apply_rotary_pos_emb(k_pos_emb, rotary_pos_emb[1], config=self.config,
                                             cu_seqlens=None)
        k_pos_emb = k_pos_emb.expand(q_len, bsz, n, self.qk_pos_emb_head_dim)
        query = torch.cat([q_no_pe, q_pos_emb], dim=-1)
        key = torch.cat([k_no_pe, k_pos_emb], dim=-1)
        core_attn_out = self.core_attention(query, key, value, attention_mask,
                                            packed_seq_params=packed_seq_params)
        return self.linear_proj(core_attn_out)


def mla_config(*, hidden_size=64, heads=4, q_lora_rank=24, kv_lora_rank=32, qk_head_dim=16,
               qk_pos_emb_head_dim=8, v_head_dim=12):
    """The TransformerConfig fields the module and Megatron's rope read."""
    return SimpleNamespace(hidden_size=hidden_size, num_attention_heads=heads,
                           q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
                           qk_head_dim=qk_head_dim, qk_pos_emb_head_dim=qk_pos_emb_head_dim,
                           v_head_dim=v_head_dim, sequence_parallel=False, apply_rope_fusion=False,
                           rotary_interleaved=False, multi_latent_attention=True,
                           mrope_section=None)


def rope_table(seq_len: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """Megatron's rotary table [S, 1, 1, dim] (non-interleaved) for positions 0..S-1."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return torch.cat([freqs, freqs], dim=-1)[:, None, None, :]

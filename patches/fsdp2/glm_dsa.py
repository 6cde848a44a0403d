"""LAGA for GLM-5/5.2 (``glm_moe_dsa``) on MindSpeed-LLM's FSDP2 backend: the sparse form.

The backend's GLM-5.2 (``model_id: glm52``) is MindSpeed-LLM's own
``mindspeed_llm.fsdp2.models.glm52.modeling_glm_moe_dsa.GlmMoeDsaAttention``: DeepSeek-V3
MLA with the DSA indexer and GLM-5.2's shared picks (``config.indexer_types``: a
"shared" layer has no indexer and reuses ``prev_topk_indices``, the picks the layer before
it returned; the model's layer loop carries them). :func:`laga_glm_dsa_forward` replaces
that module's ``forward`` under context parallelism with the same signature and returns.

The module's own submodules build, from this rank's tokens only, what its forward
builds: the query (rope at the rank's positions, from the layer's ``position_embeddings``),
the latent ``kv_latent``, the rope key, and the indexer's query, key and weights (its
``build_index_tensors``, from the detached hidden states and query latent). LAGA's core
(``mindspeed_laga.sparse_laga_attention``) gathers ``[kv_latent | k_pos_emb | index_key]``
once, or ``[kv_latent | k_pos_emb]`` on a shared layer given the picks, and returns the
attention output, the picks (global key positions of this rank's queries, -1: none) and
the indexer's KL loss, which goes to the host's tracker and auto-scaler as its forward
hands its own. Nothing of size S_local x S is built: the host's CP forward gathers every
hidden state and fills a dense ``[b, S, S]`` mask instead.

The host's flags pick each stage's kernel as they pick the host's ops
(:func:`glm_kernels`). The host's ``attention_mask`` is not read: LAGA attends causally by
global position, which is what the host's CP 1 forward computes for a batch without
padding or with padding after the tokens (the backend's tokenizer pads on the right: a
pad key is never before a real query). The glm52 model reads no document boundaries
(its forward attends across packed documents), and neither does this one.
"""
from __future__ import annotations

import sys

import torch
from torch.distributed.tensor import DTensor

from mindspeed_laga.sparse.form import sparse_laga_attention

from . import host as fsdp2_host
from ..common import agree_per_micro_batch, check_weight_once

# where the host's flags turn its fused ops on (its forward tests the query's device type)
FUSED_DEVICE_TYPES = ("npu",)
# the host's ``parallel.cp_type`` -> how its batch split lays the sequence over the CP ranks
# (trainer.py: ulysses slices contiguously, ring takes chunks r and 2*CP-1-r)
LAYOUTS = {"ulysses": "contiguous", "ring": "zigzag"}
# what this forward uses of the glm52 model's module (release 26.1.0): missing ones name the
# host the forward was not written for
HOST_PIECES = ("get_args", "apply_rotary_pos_emb_interleave", "_as_local_tensor",
               "IndexerLossAutoScaler", "IndexerLossLoggingHelper")


def laga_glm_dsa_forward(self, hidden_states, position_embeddings, attention_mask,
                         past_key_values=None, position_ids=None, cache_position=None,
                         prev_topk_indices=None, **kwargs):
    """``GlmMoeDsaAttention.forward`` under CP with LAGA's sparse form: returns
    ``(attn_output [b, s, hidden], None, topk_indices [b, s, k])`` as the host's does.

    ``hidden_states`` [b, s, hidden] and ``position_embeddings`` (cos, sin) [b, s, d_r] are
    this rank's tokens; ``prev_topk_indices``: a shared layer's picks (this forward's return
    on the layer that computed them)."""
    _refuse(self, past_key_values, prev_topk_indices)
    host = _host(self)
    args = host.get_args()
    layout = _layout(args)
    cp_group = fsdp2_host.cp_group()
    query, kv_latent, k_pos_emb, q_resid = _mla_inputs(self, host, hidden_states,
                                                       position_embeddings)
    kernels = glm_kernels(self, args, query)
    with_loss = kernels.pop("with_loss")
    shared = self.indexer is None
    index = (None,) * 3 if shared else _index_inputs(self, hidden_states, q_resid,
                                                     position_embeddings, kv_latent.dtype,
                                                     with_loss)
    check_ranks = agree_per_micro_batch(self, cp_group)
    # on the module's first call every CP rank must hold the same (unsharded) up-projection
    kv_up_weight = check_weight_once(bool(check_ranks),
                                     lambda: host._as_local_tensor(self.kv_b_proj.weight), cp_group)
    result = sparse_laga_attention(
        query, kv_latent, k_pos_emb, kv_up_weight, *index,
        index_topk=self.config.index_topk, softmax_scale=self.scaling,
        qk_head_dim=self.qk_nope_head_dim, v_head_dim=self.v_head_dim, cp_group=cp_group,
        layout=layout,
        indexer_loss_coeff=args.indexer_loss_coeff if with_loss and not shared else None,
        check_ranks=check_ranks,
        topk_indices=prev_topk_indices if shared else None, **kernels)
    core_out = _attach_loss(host, result.output, result.indexer_loss)  # [s, b, n * v]
    attn_output = self.o_proj(core_out.transpose(0, 1).contiguous())
    return attn_output, None, result.topk_indices


def _attach_loss(host, core_out, loss):
    """What the host's forward does with its indexer loss: track it, and give it its
    gradient (the main loss's backward scale) through the attention output."""
    if loss is None:
        return core_out
    host.IndexerLossLoggingHelper.save_loss_to_tracker(loss)
    return host.IndexerLossAutoScaler.apply(core_out, loss)


def _host(module):
    """The module's own model file, with every piece this forward reads from it."""
    host = sys.modules[type(module).__module__]
    missing = [name for name in HOST_PIECES if not hasattr(host, name)]
    if module.indexer is not None and not hasattr(module.indexer, "build_index_tensors"):
        missing.append("GlmMoeDsaIndexer.build_index_tensors")
    if missing:
        raise ValueError(f"LAGA's GLM-5.2 forward was written for MindSpeed-LLM 26.1.0's glm52 "
                         f"model; {host.__name__} lacks {', '.join(missing)}")
    return host


def _layout(args) -> str:
    """LAGA's layout of the backend's batch split (``LAYOUTS``)."""
    if args.cp_type not in LAYOUTS:
        raise ValueError(f"LAGA's GLM-5.2 forward maps parallel.cp_type {sorted(LAYOUTS)}; "
                         f"got {args.cp_type!r}")
    return LAYOUTS[args.cp_type]


def _mla_inputs(self, host, hidden_states, position_embeddings):
    """(query [s, b, n, nope + rope], kv_latent [s, b, d_c], k_pos_emb [s, b, d_r], q_resid)
    of this rank's tokens, built by the module's submodules as its forward builds them."""
    b, s = hidden_states.shape[:2]
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
    q_states = self.q_b_proj(q_resid).view(b, s, -1, self.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
    k_pass, k_rot = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    kv_latent = self.kv_a_layernorm(k_pass)
    k_rot = k_rot.view(b, 1, s, self.qk_rope_head_dim)
    cos, sin = position_embeddings
    q_rot, k_rot = host.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    query = torch.cat([q_pass, q_rot], dim=-1).permute(2, 0, 1, 3)  # [b, n, s, d] -> [s, b, n, d]
    return query, kv_latent.transpose(0, 1), k_rot[:, 0].transpose(0, 1), q_resid


def _index_inputs(self, hidden_states, q_resid, position_embeddings, dtype, with_grad):
    """(index_query [s, b, H, D], index_key [s, b, D], index_weights [s, b, H]) of this
    rank's tokens, by the indexer's own ``build_index_tensors`` (rope at the rank's
    positions); with a gradient only when the loss trains them, as the host builds them."""
    context = torch.enable_grad() if with_grad else torch.no_grad()
    with context:
        q, k, weights = self.indexer.build_index_tensors(
            hidden_states.detach(), q_resid.detach(), position_embeddings)
    return q.transpose(0, 1), k[:, :, 0].transpose(0, 1).to(dtype), weights.transpose(0, 1)


def glm_kernels(module, args, query) -> dict:
    """``sparse_laga_attention``'s kernel per stage, as the host's flags and its device test
    pick its ops, and ``with_loss``: whether the layer trains the indexer with the KL loss.

    The host runs ``npu_sparse_flash_attention`` under ``use_sparse_flash_attn`` (dropout
    0, no cache), ``npu_lightning_indexer`` under ``use_fused_lightning_indexer``, and its
    indexer loss only fused, behind sparse flash attention, under
    ``use_fused_lightning_indexer_loss`` while training (scaled by ``indexer_loss_coeff``);
    every op only on an NPU tensor. Its fused loss's target is the attention at the picks."""
    fused = query.device.type in FUSED_DEVICE_TYPES
    dropout = module.attention_dropout if module.training else 0.0
    sparse_flash = bool(args.use_sparse_flash_attn) and fused and dropout == 0.0
    with_loss = (sparse_flash and module.training and torch.is_grad_enabled()
                 and bool(args.use_fused_lightning_indexer_loss))
    return dict(indexer_kernel="npu" if args.use_fused_lightning_indexer and fused else "torch",
                attention_kernel="npu" if sparse_flash else "torch",
                loss_kernel="npu" if with_loss else "torch", loss_target="picks",
                with_loss=with_loss)


def _refuse(module, past_key_values, prev_topk_indices):
    """What LAGA's GLM-5.2 forward cannot take, refused alike on every rank before any
    collective (each condition is the same on every CP rank of a layer call)."""
    name = type(module).__name__
    if not hasattr(module, "skip_topk"):
        raise ValueError(
            f"LAGA's GLM-5.2 forward is for MindSpeed-LLM's glm52 {name} (model.model_id: "
            f"glm52); this {name} (transformers' glm_moe_dsa) scores its indexer without "
            f"the ReLU LAGA's sparse form applies: use model.model_id: glm52")
    # the model hands every training forward an empty cache (use_cache defaults to true);
    # nothing reads it back in training, so only a cache in use is refused
    if past_key_values is not None and (
            not module.training or not hasattr(past_key_values, "get_seq_length")
            or past_key_values.get_seq_length(module.layer_idx)):
        raise ValueError(f"LAGA's GLM-5.2 forward trains without a KV cache: {name} got "
                         f"past_key_values; run it with use_cache=False")
    if module.training and module.attention_dropout:
        raise ValueError(f"LAGA's GLM-5.2 forward has no attention dropout: set the model's "
                         f"attention_dropout to 0 (got {module.attention_dropout})")
    weight = module.kv_b_proj.weight
    if isinstance(weight, DTensor) and any(p.is_shard() for p in weight.placements):
        raise ValueError(f"LAGA's GLM-5.2 forward needs {name}'s whole kv_b_proj weight in its "
                         f"forward; it is split ({weight.placements}): set parallel.tp_size 1")
    if module.indexer is None and prev_topk_indices is None:
        raise ValueError(f"{name} layer {module.layer_idx} is a shared DSA layer "
                         f"(indexer_types 'shared') and got no prev_topk_indices: its "
                         f"picks come from the full layer before it")

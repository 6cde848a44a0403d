"""LAGA for MindSpeed-LLM's sparse MLA (``CustomMLASelfAttention`` with the DSA indexer:
DeepSeek-V3.2, GLM-5), the host's non-fused and fused paths.

The module's own submodules build, from this rank's tokens only, what the host's
forwards (``mla_naive_attention``, ``mla_absorb_attention``) build: the query, the latent
and the rope key
(rope in complex form unless ``--apply-rope-no-in-complex``), and the indexer's query,
key and weights (``DSAIndexer.forward_with_index``: from the detached hidden states and
the detached query latent as each host path feeds it, :func:`_index_latent`, but without
the host's ulysses gathers of q, k and the hidden states). The core
(``mindspeed_laga.sparse_laga_attention``) gathers ``[kv_latent | k_pos_emb | index_key]``
once and returns the attention output, the picks and the indexer's KL loss, which goes to
the host's own loss tracker and loss auto-scaler exactly as the host's forward hands it.

GLM-5.2's index share: a Compute layer whose picks later layers reuse stores LAGA's
picks in the host's holder with the host's store function; a Share layer (no indexer)
loads them with the host's load function and calls the core with them given
(``topk_indices``): it gathers ``[kv_latent | k_pos_emb]`` only and has no indexer loss.

Each stage runs on the kernel the host's flags pick for it (:func:`dsa_kernels`): the
indexer's top-k on ``npu_lightning_indexer`` under ``--use-fused-lightning-indexer``, the
attention on ``npu_sparse_flash_attention`` under ``--use-sparse-flash-attn``, the indexer
loss on ``npu_sparse_lightning_indexer_grad_kl_loss`` where the host's absorbed path runs
its fused loss; else the torch kernel, as the host's torch path. Under tensor parallelism
the indexer reads the whole sequence (gathered over TP under sequence parallelism, as the
host gathers it), and the fused loss sums the attention over every TP rank's heads, as
the host's fused loss does (its torch loss reads this rank's heads).

Under every mapped algorithm the queries stay local and no head is split (a ulysses
recipe runs the gather form on its contiguous split): docs/SPARSE_MLA.md, section
"Ulysses recipes: the gather instead of the head split".
"""
from __future__ import annotations

import sys

import torch

from mindspeed_laga.features.laga_args import laga_settings
from mindspeed_laga.sparse.form import sparse_laga_attention
from mindspeed_laga.sparse.registry import HOST_DEFAULT, host_kernels

from .fb_overlap import hook_a2a, launch_a2a


def is_dsa(module) -> bool:
    """The module runs sparse MLA: its own DSA indexer, or (GLM-5.2's index share) the
    picks of an earlier layer, its indexer then an ``IdentityOp`` (``_skip_dsa_topk``)."""
    return (type(getattr(module, "dsa_indexer", None)).__name__ == "DSAIndexer"
            or bool(getattr(module, "_skip_dsa_topk", False)))


def laga_dsa_attention(self, hidden_states, rotary_pos_emb, cp_group, megatron_args,
                       inputs, kv_up_weight, softmax_scale, check_ranks=None, carriers=(None, None),
                       cu_seqlens=None):
    """Sparse MLA with LAGA as the core; returns ``linear_proj``'s (output, bias).

    ``check_ranks``: the core's (True on the module's first call, None after: the ranks
    agree once per micro-batch, patches/common.py).
    ``inputs``: the module's MLA inputs built with :func:`dsa_rope` (forward.py's
    ``MlaInputs``: ``query``, ``kv_latent``, ``k_pos_emb``, and the query latents
    ``q_compressed`` / ``q_normed`` the indexer reads).
    ``carriers``: (packed_seq_params, attention_mask) of the layer's call, which with the
    rope and the config carry the host's holder of shared picks (:func:`_share_holder`).
    ``cu_seqlens``: the global document boundaries under --reset-attention-mask
    (forward.py's ``document_boundaries``), or None."""
    args = megatron_args
    host = sys.modules[type(self).__module__]
    query, kv_latent, k_pos_emb = inputs.query, inputs.kv_latent, inputs.k_pos_emb
    holder = _share_holder(self, host, carriers, rotary_pos_emb)
    shared = bool(getattr(self, "_skip_dsa_topk", False))
    index = (None,) * 3 if shared else _index_inputs(self, hidden_states, inputs,
                                                     rotary_pos_emb, args)
    training = self.training and torch.is_grad_enabled() and not shared
    launch_a2a(self)
    result = sparse_laga_attention(
        query, kv_latent, k_pos_emb, kv_up_weight, *index, index_topk=args.index_topk,
        softmax_scale=softmax_scale, qk_head_dim=self.qk_head_dim, v_head_dim=self.v_head_dim,
        cp_group=cp_group, layout=laga_settings(args).layout,
        indexer_loss_coeff=args.indexer_loss_coeff if training else None,
        check_ranks=check_ranks, cu_seqlens=cu_seqlens,
        topk_indices=_load_picks(self, host, holder, query) if shared else None,
        **dsa_kernels(self, args))
    if holder is not None and not shared:  # a Compute layer whose picks later layers reuse
        host.store_dsa_index_share_topk(
            holder, source_layer=self._dsa_global_layer_number, topk_indices=result.topk_indices,
            seq_len=query.shape[0], batch_size=query.shape[1])
    core_out = result.output
    if result.indexer_loss is not None:
        core_out = _attach_loss(self, host, args, core_out, result.indexer_loss)
    hook_a2a(self, core_out)
    return self.linear_proj(core_out)


def _index_inputs(self, hidden_states, inputs, rotary_pos_emb, args):
    """(index_query, index_key, index_weights) of a layer that runs its own indexer."""
    rope = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
    x, qr = _whole_sequence(self, hidden_states.detach(), _index_latent(self, inputs).detach())
    index_query, index_key, index_weights = index_inputs(self.dsa_indexer, x, qr, rope, args)
    return index_query, index_key.to(inputs.kv_latent.dtype), index_weights


def _share_holder(self, host, carriers, rotary_pos_emb):
    """The host's per-forward holder of shared picks, as its forward finds it (None: the
    layer neither shares nor is shared from). LAGA's picks, global key positions of this
    rank's queries, go in and out of it under the host's key (the Compute layer's global
    layer number) through the host's own store and load functions."""
    if not getattr(self, "_dsa_index_share", False):
        return None
    packed_seq_params, attention_mask = carriers
    return host.get_dsa_index_share_holder(packed_seq_params, attention_mask, self.config,
                                           rotary_pos_emb=rotary_pos_emb)


def _load_picks(self, host, holder, query):
    """A Share layer's picks: its Compute layer's, for this rank's queries."""
    return host.load_dsa_index_share_topk(
        holder, current_layer=self._dsa_global_layer_number, source_layer=self._dsa_source_layer,
        seq_len=query.shape[0], batch_size=query.shape[1])


def dsa_kernels(module, args) -> dict:
    """``sparse_laga_attention``'s kernel per stage, as the host's flags pick its ops: each
    stage kernel declares the flag that selects it (``host_flags``, read through the
    registry's :func:`host_kernels`).

    The host's fused loss runs only in its absorbed path (``enable_mla_absorb``, which the
    module keeps on with sparse flash attention or ``--mla-mm-split``); its non-absorbed
    path computes the loss in torch even under ``--use-fused-lightning-indexer-loss``.
    The fused loss reads every head: under TP it gathers them (``loss_tp_group``). The
    torch loss behind sparse flash attention takes its target from the unmasked attention
    over every key (``loss_target``: the host's ``get_attn_scores`` gets no mask there)."""
    from megatron.core import parallel_state

    absorbed = bool(getattr(module, "enable_mla_absorb", False))

    def flag_on(stage, flag):  # the host's loss flags act on its absorbed path only
        return bool(getattr(args, flag, False)) and (stage != "loss" or absorbed)

    kernels = host_kernels(flag_on)
    fused_loss = kernels["loss_kernel"] != HOST_DEFAULT
    sparse_flash = kernels["attention_kernel"] != HOST_DEFAULT
    tp_split = parallel_state.get_tensor_model_parallel_world_size() > 1
    return dict(
        kernels,
        loss_tp_group=parallel_state.get_tensor_model_parallel_group()
        if fused_loss and tp_split else None,
        # the host's torch loss behind its sparse flash attention gets no mask
        loss_target="all_keys" if sparse_flash and not fused_loss else "picks")


def _index_latent(self, inputs):
    """The query latent the host's indexer reads: its absorbed path feeds the latent after
    the query layernorm (and before the q-lora scale), its non-absorbed path the latent
    before the layernorm (the reference DeepSeek-V3.2 reads it after)."""
    if getattr(self, "enable_mla_absorb", False) and inputs.q_normed is not None:
        return inputs.q_normed
    return inputs.q_compressed


def _whole_sequence(self, x, qr):
    """The indexer's inputs over this CP rank's whole sequence: under sequence parallelism
    gathered over TP, as the host's forward gathers them (they carry no gradient)."""
    if not self.config.sequence_parallel:
        return x, qr
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
    return gather_from_sequence_parallel_region(x), gather_from_sequence_parallel_region(qr)


def _attach_loss(self, host, args, core_out, loss):
    """What the host's forward does with its indexer loss: log it, and give it its
    gradient (the main loss's scale) through the attention output."""
    from megatron.core import parallel_state
    host.DSAIndexerLossLoggingHelper.save_loss_to_tracker(
        loss, host._get_layer_offset(args) + self.layer_number, self.config.num_layers,
        avg_group=parallel_state.get_tensor_and_context_parallel_group())
    return host.DSAIndexerLossAutoScaler.apply(core_out, loss)


def dsa_rope(module, args):
    """The rope the host's DSA forward applies to q_pos_emb / k_pos_emb, with the adapter's
    call signature (t, freqs, config=, cu_seqlens=)."""
    host = sys.modules[type(module).__module__]
    if getattr(args, "apply_rope_no_in_complex", False):
        return None  # the module's apply_rotary_pos_emb, as without DSA

    def in_complex(t, freqs, config=None, cu_seqlens=None):
        return host.apply_rotary_pos_emb_bshd_in_complex(t, _rank_rows(freqs, t.shape[0]),
                                                         rotary_interleaved=False)

    return in_complex


def _rank_rows(freqs, tokens):
    """The rope rows of this rank's tokens. With packed documents (THD) the layer's rope
    covers the whole sequence, and the host's THD rope picks each rank's rows itself; its
    DSA rope (in complex form, and the indexer's) takes the rows as given, which at CP 1
    are the tokens' positions in the sequence. The host splits packed batches
    contiguously, so this rank's tokens hold the positions of its chunk."""
    if freqs.shape[0] == tokens:
        return freqs
    from megatron.core import parallel_state
    if freqs.shape[0] != tokens * parallel_state.get_context_parallel_world_size():
        return freqs  # not the whole sequence: the host's rope says what is wrong
    rank = parallel_state.get_context_parallel_rank()
    return freqs[rank * tokens:(rank + 1) * tokens]


def index_inputs(indexer, x, qr, rope, args):
    """(index_query [s, b, H, D], index_key [s, b, D], index_weights [s, b, H]) of this
    rank's tokens, as the host's ``DSAIndexer.forward_with_index`` computes them."""
    host = sys.modules[type(indexer).__module__]
    s, b, _ = x.shape
    q = indexer.wq_b(qr).view(s, b, indexer.n_heads, indexer.head_dim)
    rope_dim = indexer.rope_head_dim
    q_pe, q_nope = torch.split(q, [rope_dim, indexer.head_dim - rope_dim], dim=-1)
    q = torch.cat([_index_rope(host, indexer, q_pe, rope[0], args), q_nope], dim=-1)
    k = indexer.k_norm(indexer.wk(x))
    k_pe, k_nope = torch.split(k, [rope_dim, indexer.head_dim - rope_dim], dim=-1)
    k_pe = _index_rope(host, indexer, k_pe.unsqueeze(2), rope[1], args).view(s, b, rope_dim)
    k = torch.cat([k_pe, k_nope], dim=-1)
    if not getattr(args, "no_use_sparse_c8_indexer", False):
        q, k = host.rotate_activation(q), host.rotate_activation(k)
    weights = indexer.weights_proj(x) * indexer.n_heads ** -0.5 * indexer.softmax_scale
    return q, k, weights


def _index_rope(host, indexer, t, freqs, args):
    freqs = _rank_rows(freqs, t.shape[0])
    if getattr(args, "apply_rope_no_in_complex", False):
        return host.apply_rotary_pos_emb(t, freqs, config=indexer.config)
    return host.apply_rotary_pos_emb_bshd_in_complex(t, freqs, rotary_interleaved=True)

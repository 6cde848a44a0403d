"""What differs between the megatron-core releases ``patches/megatron_core/mla.py`` supports.

The LAGA forward copies pieces of ``MLASelfAttention.get_query_key_value_tensors``;
the pieces that moved between releases are chosen here, by what the installed
release has (not by its version string), so the copied forward stays one text:

- the q/kv down-projection: 0.17 moved it into ``_qkv_down_projection`` (which
  ``FusedMLASelfAttention`` overrides with one fused ``linear_qkv_down_proj``);
  0.16.1 inlines it in the forward;
- the MLA rope keyword of ``_apply_rotary_pos_emb_bshd``: 0.16.1-0.18's
  ``multi_latent_attention`` became ``mla_rotary_interleaved`` in 0.19 (the old
  name still works there but warns on every call).
"""
from __future__ import annotations

import functools
import inspect

import torch


def qkv_down_projection(module, hidden_states, tp_group):
    """hidden -> (q_compressed [.., q_lora_rank or hidden], kv_combined [.., d_c + d_r (/TP)]).

    ``kv_combined`` is returned as the projection leaves it (TP-split when the
    projection is column-parallel); the caller splits it as the original does.
    """
    own = getattr(module, "_qkv_down_projection", None)
    if own is not None:  # megatron-core >= 0.17: the module's own (maybe fused) projection
        return own(hidden_states)
    return _qkv_down_projection_0_16(module, hidden_states, tp_group)


def _qkv_down_projection_0_16(module, hidden_states, tp_group):
    """The inlined down-projection of megatron-core 0.16.1's forward."""
    from megatron.core.tensor_parallel.mappings import (
        gather_from_tensor_model_parallel_region, scatter_to_sequence_parallel_region)
    cfg = module.config
    if cfg.q_lora_rank is not None:
        q_compressed, _ = module.linear_q_down_proj(hidden_states)
        if q_compressed.size(-1) != cfg.q_lora_rank:
            q_compressed = gather_from_tensor_model_parallel_region(q_compressed, group=tp_group)
            if cfg.sequence_parallel:
                q_compressed = scatter_to_sequence_parallel_region(q_compressed, group=tp_group)
    else:
        q_compressed = hidden_states
    kv_combined, _ = module.linear_kv_down_proj(hidden_states)
    return q_compressed, kv_combined


@functools.lru_cache(maxsize=None)
def _mla_rope_keyword(apply_bshd) -> str:
    params = inspect.signature(apply_bshd).parameters
    return "mla_rotary_interleaved" if "mla_rotary_interleaved" in params \
        else "multi_latent_attention"


def apply_mla_rope(x: torch.Tensor, table: torch.Tensor, rotary_interleaved: bool,
                   mscale: float) -> torch.Tensor:
    """megatron's unfused MLA rope on [s, b, n, d] (the fused kernels slice zigzag inside)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    keyword = _mla_rope_keyword(_apply_rotary_pos_emb_bshd)
    return _apply_rotary_pos_emb_bshd(x, table, rotary_interleaved=rotary_interleaved,
                                      mscale=mscale, **{keyword: True})

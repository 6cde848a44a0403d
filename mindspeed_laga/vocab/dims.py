"""MLA sizes: one TP rank's (:class:`MLADims`) and the whole model's (:class:`ModelDims`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class _DerivedDims:
    """The widths both kinds of dims derive alike."""

    @property
    def qk_dim(self) -> int:
        """Query/key head dim: d_n + d_r."""
        return self.qk_head_dim + self.rope_dim

    @property
    def latent_dim(self) -> int:
        """Values per token LAGA gathers: d_c + d_r."""
        return self.kv_lora_rank + self.rope_dim


@dataclass(frozen=True)
class MLADims(_DerivedDims):
    """MLA sizes as one TP rank holds them (DeepSeek-V3 at TP=1: 128, 128, 64, 128, 512)."""

    heads: int          # n: heads on this TP rank
    qk_head_dim: int    # d_n
    rope_dim: int       # d_r (qk_pos_emb_head_dim)
    v_head_dim: int     # d_v
    kv_lora_rank: int   # d_c


@dataclass(frozen=True)
class ModelDims(_DerivedDims):
    """MLA sizes of the whole model (heads before TP), as a model config states them."""

    heads: int
    qk_head_dim: int
    rope_dim: int
    v_head_dim: int
    kv_lora_rank: int
    hidden_size: Optional[int] = None   # only for the query-projection (overlap) estimate
    q_lora_rank: Optional[int] = None

    def per_tp_rank(self, tp_size: int) -> MLADims:
        """The sizes one of ``tp_size`` tensor-parallel ranks holds."""
        return MLADims(self.heads // tp_size, self.qk_head_dim, self.rope_dim, self.v_head_dim,
                       self.kv_lora_rank)

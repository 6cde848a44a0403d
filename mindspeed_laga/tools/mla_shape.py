"""The full-sequence MLA sizes of one run; torch-free, so the CLI's parsers can name them
before torch is imported (``cases`` re-exports it)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MLAShape:
    """Full-sequence MLA sizes. The default is DeepSeek-shaped but tiny."""

    seq_len: int = 64
    batch: int = 2
    heads: int = 8
    qk_head_dim: int = 16
    rope_dim: int = 8
    v_head_dim: int = 16
    kv_lora_rank: int = 32

    @property
    def softmax_scale(self) -> float:
        return (self.qk_head_dim + self.rope_dim) ** -0.5

"""Attention and K/V-rebuild FLOPs of one variant on one rank.

Attention (Q.K^T and P.V): ``executed`` = the rectangles our kernels run,
masked keys included (what ``FlopCounterMode`` counts); ``visible`` = causal
pairs (within documents) only. Rebuild: the K/V up-projection (for absorbed, the q.W_UK and
o_latent.W_UV products that replace it).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Tuple

from ..runspec import RunSpec
from .config import RECOMPUTING_KINDS, Config
from .geometry import attention_pairs, blockwise_rebuilds, rebuilt_keys


@dataclass(frozen=True)
class Flops:
    attention_fwd: int
    attention_bwd: int
    attention_visible_fwd: int
    rebuild_fwd: int
    rebuild_bwd: int

    @property
    def total(self) -> int:
        return self.attention_fwd + self.attention_bwd + self.rebuild_fwd + self.rebuild_bwd

    def as_dict(self) -> dict:
        return asdict(self)


def _matmul_flops(pairs: int, b: int, h: int, qk_dim: int, v_dim: int) -> Tuple[int, int, int]:
    """FLOPs over ``pairs`` (query, key) pairs: forward Q.K^T + P.V; backward of a kernel
    that keeps the scores (dQ, dK: qk; dP, dV: v) and of one that recomputes them first
    (flash-style: Q.K^T again, then dP, dV, dQ, dK)."""
    unit = 2 * b * h * pairs
    return unit * (qk_dim + v_dim), unit * 2 * (qk_dim + v_dim), unit * (3 * qk_dim + 2 * v_dim)


def flops(cfg: Config, rank: int, kind: str, spec: RunSpec) -> Flops:
    z = cfg.sizes
    d, b, s, n, h = z.dims, z.batch, z.local_len, z.tp_heads, z.heads
    absorbed = spec.form == "absorbed"
    qk_dim, v_dim = (d.latent_dim, d.kv_lora_rank) if absorbed else (d.qk_dim, d.v_head_dim)
    pairs = attention_pairs(cfg, rank, spec)
    fwd, bwd_kept, bwd_recomputed = _matmul_flops(pairs.executed, b, h, qk_dim, v_dim)
    recomputes = spec.recompute_kv or kind in RECOMPUTING_KINDS
    visible_fwd = _matmul_flops(pairs.visible, b, h, qk_dim, v_dim)[0]
    kv_rows = d.qk_head_dim + d.v_head_dim
    if absorbed:
        # q_nope . W_UK on every local head (before the all-to-all), o_latent . W_UV
        rebuild = (2 * s * b * n * d.qk_head_dim * d.kv_lora_rank
                   + 2 * cfg.query_len * b * h * d.kv_lora_rank * d.v_head_dim)
        rebuild_bwd = 2 * rebuild
    else:
        if spec.form == "explicit":  # local latent -> K/V of every local head
            rebuild = 2 * s * b * d.kv_lora_rank * n * kv_rows
        else:  # gathered latent -> K/V of every (visible) key, this rank's heads; blockwise:
            # every row block rebuilds the keys it sees
            keys = blockwise_rebuilds(cfg, rank, spec) if spec.recompute_kv else rebuilt_keys(cfg, rank, spec)
            rebuild = keys * 2 * b * d.kv_lora_rank * h * kv_rows
        # recompute: rebuilt again in backward, then dK/dV -> d(latent), d(kv_up_weight)
        rebuild_bwd = (3 if spec.recompute_kv else 2) * rebuild
    return Flops(fwd, bwd_recomputed if recomputes else bwd_kept, visible_fwd, rebuild, rebuild_bwd)


def query_projection_flops(cfg: Config) -> Optional[int]:
    """Forward FLOPs of this rank's query projection (the window the latent gather can hide in)."""
    d = cfg.dims
    width = d.q_lora_rank or d.hidden_size
    if width is None:
        return None
    return 2 * cfg.local_len * cfg.micro_batch * width * cfg.tp_heads * d.qk_dim

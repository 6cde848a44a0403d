"""AllGather CP: queries stay local with every head; K/V (explicit) or the latent are gathered."""
from __future__ import annotations

from .base import CPAlgo, Exchange


class AllGather(CPAlgo):
    name = "allgather"
    default_layout = "zigzag"
    host_algo = "kvallgather_cp_algo"  # megatron_cp_algo's layout too; LAGA replaces its ring

    def exchanges(self, form, d, n):
        if form == "explicit":
            return [Exchange("all_gather", "key", n * d.qk_dim, "cp"),
                    Exchange("all_gather", "value", n * d.v_head_dim, "cp")]
        return [Exchange("all_gather", "latent", d.latent_dim, "cp")]

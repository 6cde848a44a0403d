"""Ulysses CP: heads split over the whole CP group by all-to-all; each rank attends every token."""
from __future__ import annotations

from .base import CPAlgo, Exchange, latent_exchanges


class Ulysses(CPAlgo):
    name = "ulysses"
    default_layout = "contiguous"
    host_algo = "ulysses_cp_algo"

    def heads_split(self, cp_size, ulysses_degree=1):
        return cp_size > 1

    def exchanges(self, form, d, n):
        if form == "explicit":
            return [Exchange("all_to_all", "query", n * d.qk_dim, "cp"),
                    Exchange("all_to_all", "key", n * d.qk_dim, "cp"),
                    Exchange("all_to_all", "value", n * d.v_head_dim, "cp"),
                    Exchange("all_to_all", "output", n * d.v_head_dim, "cp")]
        return latent_exchanges(form, d, n, "cp")

"""Hybrid CP: heads split inside the Ulysses group (U consecutive CP ranks, CP rank
c = r*U + u); the latent crosses the whole CP group, explicit's K/V the ring group of
the R = P/U ranks with the same Ulysses rank (docs/DESIGN.md "Hybrid CP")."""
from __future__ import annotations

from .base import CPAlgo, Exchange, latent_exchanges


class Hybrid(CPAlgo):
    name = "hybrid"
    default_layout = "zigzag"
    host_algo = "hybrid_cp_algo"
    takes_ulysses_degree = True
    # An algorithm the cost model's one-link tables and "both" leave out: plan and bench
    # show it on its own (--cp-algo hybrid) and in the two-link node table.
    in_tables = False
    split_label = "ulysses"
    split_rows_label = "U*s"

    def heads_split(self, cp_size, ulysses_degree=1):
        return ulysses_degree > 1

    def split_size(self, cp_size, ulysses_degree=1):
        return ulysses_degree

    def split_rank(self, cp_rank, ulysses_degree=1):
        return cp_rank % ulysses_degree

    def split_group(self, cp_group, ulysses_group):
        return ulysses_group

    def every_token(self, x, setup, tag):
        """[U*s, ...] of this Ulysses group -> all-gather over the ring group -> [P*s, ...]."""
        from .. import comm  # torch: only the forms reach here
        ring = comm.hybrid_ring_group(setup.cp_group, setup.ulysses_group)
        return comm.gather_seq(x, ring, tag, "ring")

    def exchanges(self, form, d, n):
        if form == "explicit":
            # All-to-all Q, K, V of every local head inside the Ulysses group -> n/U heads of
            # U*s tokens; the ring gathers those heads' K/V (U*s*(n/U) = s*n values per head dim).
            return [Exchange("all_to_all", "query", n * d.qk_dim, "ulysses"),
                    Exchange("all_to_all", "key", n * d.qk_dim, "ulysses"),
                    Exchange("all_to_all", "value", n * d.v_head_dim, "ulysses"),
                    Exchange("all_gather", "key", n * d.qk_dim, "ring"),
                    Exchange("all_gather", "value", n * d.v_head_dim, "ring"),
                    Exchange("all_to_all", "output", n * d.v_head_dim, "ulysses")]
        return latent_exchanges(form, d, n, "ulysses")

"""Collectives per form and cp_algo, with the byte counter's measures.

``payload``: this rank's sequence-sharded tensor handed to the collective;
``wire``: the bytes this rank sends (ring all-gather / reduce-scatter
``(P-1) * payload``, all-to-all ``payload * (P-1)/P``); ``design``: the
``payload * (P-1)/P`` of docs/DESIGN.md, section 'Communication'. Equal to
``comm.count_bytes`` exactly.

What each (form, cp_algo) exchanges forward is one table row; backward runs
the same collectives, an all-gather's backward being a reduce-scatter. Hybrid
CP has its own table (``HYBRID_EXCHANGES``): each collective names its group
("ulysses": U ranks, "ring": R = P/U ranks, "cp": all P), as the counter does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

from ...vocab.names import HYBRID
from ...vocab.dims import ModelDims
from .config import Config


@dataclass(frozen=True)
class Collective:
    kind: str
    direction: str
    tag: str
    payload: int
    wire: int
    design: float
    group: str = "cp"      # the byte counter's group name: "cp", "ulysses" or "ring"
    group_size: int = 0    # ranks in that group


# (kind, tag, values per local token, group size) of one forward pass. A new algorithm
# (e.g. heads split inside a node, latent gathered over the whole CP group) is one entry.
Exchange = List[Tuple[str, str, int, int]]


def _explicit_allgather(d: ModelDims, n: int, P: int) -> Exchange:
    return [("all_gather", "key", n * d.qk_dim, P), ("all_gather", "value", n * d.v_head_dim, P)]


def _explicit_ulysses(d: ModelDims, n: int, P: int) -> Exchange:
    return [("all_to_all", "query", n * d.qk_dim, P), ("all_to_all", "key", n * d.qk_dim, P),
            ("all_to_all", "value", n * d.v_head_dim, P), ("all_to_all", "output", n * d.v_head_dim, P)]


def _latent_allgather(d: ModelDims, n: int, P: int) -> Exchange:
    return [("all_gather", "latent", d.latent_dim, P)]


def _latent_ulysses(query_width: int):
    def exchange(d: ModelDims, n: int, P: int) -> Exchange:
        return [("all_to_all", "query", n * query_width(d), P), ("all_gather", "latent", d.latent_dim, P),
                ("all_to_all", "output", n * d.v_head_dim, P)]
    return exchange


EXCHANGES: Dict[Tuple[str, str], Callable[[ModelDims, int, int], Exchange]] = {
    ("explicit", "allgather"): _explicit_allgather,
    ("explicit", "ulysses"): _explicit_ulysses,
    ("laga", "allgather"): _latent_allgather,
    ("laga", "ulysses"): _latent_ulysses(lambda d: d.qk_dim),
    ("absorbed", "allgather"): _latent_allgather,
    ("absorbed", "ulysses"): _latent_ulysses(lambda d: d.latent_dim),   # q_abs is latent-wide
}
# Hybrid CP (U ranks per Ulysses group, R = P/U per ring): (kind, tag, values per
# local token, group name) of one forward pass; the group name is the byte counter's.
HybridExchange = List[Tuple[str, str, int, str]]


def _explicit_hybrid(d: ModelDims, n: int) -> HybridExchange:
    # All-to-all Q, K, V of every local head inside the Ulysses group -> n/U heads of U*s
    # tokens; the ring gathers those heads' K/V (U*s*(n/U) = s*n values per head dim).
    return [("all_to_all", "query", n * d.qk_dim, "ulysses"), ("all_to_all", "key", n * d.qk_dim, "ulysses"),
            ("all_to_all", "value", n * d.v_head_dim, "ulysses"),
            ("all_gather", "key", n * d.qk_dim, "ring"), ("all_gather", "value", n * d.v_head_dim, "ring"),
            ("all_to_all", "output", n * d.v_head_dim, "ulysses")]


def _latent_hybrid(query_width: int):
    def exchange(d: ModelDims, n: int) -> HybridExchange:
        return [("all_to_all", "query", n * query_width(d), "ulysses"),
                ("all_gather", "latent", d.latent_dim, "cp"),
                ("all_to_all", "output", n * d.v_head_dim, "ulysses")]
    return exchange


HYBRID_EXCHANGES: Dict[str, Callable[[ModelDims, int], HybridExchange]] = {
    "explicit": _explicit_hybrid,
    "laga": _latent_hybrid(lambda d: d.qk_dim),
    "absorbed": _latent_hybrid(lambda d: d.latent_dim),
}


def group_size(cfg: Config, group: str) -> int:
    """Ranks in a group of the byte counter's names."""
    return {"cp": cfg.cp_size, "ulysses": cfg.ulysses_degree, "ring": cfg.ring_size}[group]


def _exchange(cfg: Config, form: str) -> List[Tuple[str, str, int, int, str]]:
    """(kind, tag, width, group size, group name) of one forward pass."""
    if cfg.cp_algo == HYBRID:
        return [(kind, tag, width, group_size(cfg, g), g)
                for kind, tag, width, g in HYBRID_EXCHANGES[form](cfg.dims, cfg.tp_heads)]
    return [part + ("cp",) for part in EXCHANGES[(form, cfg.cp_algo)](cfg.dims, cfg.tp_heads, cfg.cp_size)]


BACKWARD_KIND = {"all_gather": "reduce_scatter", "all_to_all": "all_to_all"}


def wire_bytes(kind: str, payload: int, group_size: int) -> int:
    """Bytes one rank sends for a collective with this payload."""
    P = group_size
    return payload * (P - 1) // P if kind == "all_to_all" else (P - 1) * payload


def collectives(cfg: Config, form: str) -> List[Collective]:
    """Every collective of ``form`` at this rank, forward then backward (none without CP)."""
    P = cfg.cp_size
    if P == 1:
        return []
    tokens = cfg.local_len * cfg.micro_batch
    parts = _exchange(cfg, form)
    out = []
    for direction in ("forward", "backward"):
        for kind, tag, width, group, name in parts:
            if group == 1:   # hybrid with U = P (no ring) or U = 1: nothing to exchange
                continue
            if direction == "backward":
                kind = BACKWARD_KIND[kind]
            payload = tokens * width * cfg.elem
            out.append(Collective(kind, direction, tag, payload, wire_bytes(kind, payload, group),
                                  payload * (group - 1) / group, name, group))
    return out

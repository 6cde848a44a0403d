"""Collectives per form and cp_algo, with the byte counter's measures.

``payload``: this rank's sequence-sharded tensor handed to the collective;
``wire``: the bytes this rank sends (ring all-gather / reduce-scatter
``(P-1) * payload``, all-to-all ``payload * (P-1)/P``); ``design``: the
``payload * (P-1)/P`` of docs/DESIGN.md, section 'Communication'. Equal to
``comm.count_bytes`` exactly.

What each (form, cp_algo) exchanges forward is the algorithm's
``exchanges`` (cp_algos/); backward runs the same collectives, an all-gather's
backward being a reduce-scatter. Each collective names its group ("cp": all P,
"ulysses": U ranks, "ring": R = P/U ranks), as the counter does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

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


def group_size(cfg: Config, group: str) -> int:
    """Ranks in a group of the byte counter's names."""
    return {"cp": cfg.cp_size, "ulysses": cfg.ulysses_degree, "ring": cfg.ring_size}[group]


def _exchange(cfg: Config, form: str) -> List[Tuple[str, str, int, int, str]]:
    """(kind, tag, width, group size, group name) of one forward pass (the algorithm's
    :meth:`~mindspeed_laga.cp_algos.CPAlgo.exchanges`)."""
    return [(e.kind, e.tag, e.width, group_size(cfg, e.group), e.group)
            for e in cfg.algo.exchanges(form, cfg.dims, cfg.tp_heads)]


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

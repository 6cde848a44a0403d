"""Nodes and their two links: which bytes of a collective cross nodes, and the
per-layer time with an intra-node and an inter-node link.

Placement: CP ranks are consecutive devices (Megatron's default order
``tp-cp-ep-dp-pp``: TP innermost), so CP rank ``c``, TP rank ``t`` sits on
device ``c*TP + t`` and node ``(c*TP + t) // devices_per_node``. Hybrid CP's
Ulysses group is the U consecutive CP ranks holding a rank, its ring the
R = P/U ranks with the same Ulysses rank (``comm.hybrid_ring_group``).

Which link a collective runs at:

- a group inside one node: the intra-node link, every wire byte;
- an all-to-all over a group spanning nodes: each rank sends payload/P to each
  peer, so the bytes to peers on its node go intra-node and the rest
  inter-node; the two links run at once (time = the slower of the two);
- an all-gather / reduce-scatter over a group spanning nodes: a ring, and
  every step waits for its cross-node hops: every wire byte at the inter-node
  link.

Collectives run one after another and after the compute (no overlap except
LAGA's overlapped latent gather, as in ``time.estimate_seconds``).
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from typing import List, Tuple

from .comm import Collective
from .config import Config
from .flops import query_projection_flops
from .summary import RankSummary
from .time import MACHINES, TimeEstimate


@dataclass(frozen=True)
class Cluster:
    """Devices per node, per-rank send bandwidth of each link (GB/s), matmul throughput."""

    name: str
    intra_gbps: float
    inter_gbps: float
    tflops: float
    devices_per_node: int = 8


# 910B: the figures of time.MACHINES (HCCS mesh inside an 8-NPU node, ~196 GB/s a
# rank can send; one 200 Gb/s RoCE NIC per NPU across nodes, 25 GB/s; 160 TFLOPS
# effective). Assumptions, not measurements: override them on the command line.
CLUSTERS = {
    "910b": Cluster("910b", MACHINES["910b-intra-node"].link_gbps, MACHINES["910b-cross-node"].link_gbps,
                    MACHINES["910b-intra-node"].tflops, 8),
}


def group_members(cfg: Config, rank: int, group: str) -> List[int]:
    """CP ranks of the group (the byte counter's name) that holds ``rank``."""
    return list(group_range(cfg, rank, group))


def group_range(cfg: Config, rank: int, group: str) -> range:
    """:func:`group_members` as a range (ascending; no list of P ranks built)."""
    if group == "cp":
        return range(cfg.cp_size)
    U = cfg.ulysses_degree
    if group == "ulysses":
        first = rank - rank % U
        return range(first, first + U)
    if group == "ring":
        return range(rank % U, cfg.cp_size, U)
    raise ValueError(f"group {group!r} is unknown; use 'cp', 'ulysses' or 'ring'")


def group_nodes(cfg: Config, members: List[int], devices_per_node: int) -> List[int]:
    """The node of each member's first TP device."""
    return [(c * cfg.tp_size) // devices_per_node for c in members]


def _spans(cfg: Config, members: range, devices_per_node: int) -> bool:
    """Whether the group's devices (every TP rank of every member) cross a node boundary:
    members ascend, so its first and last devices' nodes tell."""
    tp = cfg.tp_size
    return (members[0] * tp) // devices_per_node != (members[-1] * tp + tp - 1) // devices_per_node


def ulysses_fits_node(cfg: Config, devices_per_node: int) -> bool:
    """Hybrid: every Ulysses group inside one node (the all-to-alls on the fast link)."""
    return not any(_spans(cfg, group_range(cfg, r, "ulysses"), devices_per_node)
                   for r in range(0, cfg.cp_size, cfg.ulysses_degree))


def link_bytes(cfg: Config, c: Collective, rank: int, cluster: Cluster) -> Tuple[int, int]:
    """(intra-node, inter-node) bytes ``rank`` sends for collective ``c``."""
    members = group_range(cfg, rank, c.group)
    if not _spans(cfg, members, cluster.devices_per_node):
        return c.wire, 0
    if c.kind != "all_to_all":
        return 0, c.wire
    near = _node_peers(cfg, members, rank, cluster.devices_per_node)
    far = len(members) - 1 - near
    share = c.payload // len(members)   # what one peer receives
    return near * share, far * share


def _node_peers(cfg: Config, members: range, rank: int, devices_per_node: int) -> int:
    """Members other than ``rank`` on ``rank``'s node: counted in closed form for a run of
    consecutive ranks (the node of rank c is c*TP // devices_per_node), else one by one."""
    tp = cfg.tp_size
    mine = group_nodes(cfg, [rank], devices_per_node)[0]
    if members.step != 1:
        nodes = group_nodes(cfg, members, devices_per_node)
        return sum(1 for m, node in zip(members, nodes) if node == mine and m != rank)
    first = -(-mine * devices_per_node // tp)          # ranks on node `mine`: [first, end)
    end = -(-(mine + 1) * devices_per_node // tp)
    return max(0, min(end, members.stop) - max(first, members.start)) - 1


def placement_ranks(cfg: Config, devices_per_node: int) -> range:
    """The ranks whose placements can differ (a group may span nodes on some ranks only).
    Inside one node nothing spans: rank 0 stands for all. Over whole nodes they repeat
    every lcm(U, devices per node) ranks (the groups and the nodes both shift whole), and
    where a node holds whole ranks (TP divides it) and the Ulysses groups tile the nodes
    (U divides a node's ranks, or they divide U) every rank sits alike. A last node the CP
    group fills only in part breaks the repeat: every rank then."""
    devices = cfg.cp_size * cfg.tp_size
    if devices <= devices_per_node:
        return range(1)
    if devices % devices_per_node:
        return range(cfg.cp_size)
    degree = cfg.ulysses_degree or 1
    if devices_per_node % cfg.tp_size == 0:
        per_node = devices_per_node // cfg.tp_size
        if degree % per_node == 0 or per_node % degree == 0:
            return range(1)
    return range(min(cfg.cp_size, math.lcm(degree, devices_per_node)))


def collective_seconds(cfg: Config, c: Collective, rank: int, cluster: Cluster) -> float:
    intra, inter = link_bytes(cfg, c, rank, cluster)
    return max(intra / (cluster.intra_gbps * 1e9), inter / (cluster.inter_gbps * 1e9))


@dataclass(frozen=True)
class ClusterTime(TimeEstimate):
    """A :class:`TimeEstimate` on two links, with the bytes each carries."""
    intra_bytes: int      # wire bytes on the intra-node link (fwd+bwd)
    inter_bytes: int      # wire bytes on the inter-node link (fwd+bwd)
    worst_rank: int


def _compute_seconds(summary: RankSummary, tflops: float) -> float:
    """Attention (causal-visible for a fused kernel, rectangles for blockwise) + rebuild."""
    f = summary.flops_worst
    attn = f.attention_fwd + f.attention_bwd
    if not summary.spec.recompute_kv:
        attn *= f.attention_visible_fwd / f.attention_fwd
    return (attn + f.rebuild_fwd + f.rebuild_bwd) / (tflops * 1e12)


def estimate_cluster_seconds(cfg: Config, summary: RankSummary, cluster: Cluster) -> ClusterTime:
    """Per-layer fwd+bwd time of the worst rank on ``cluster``: compute (worst rank's
    FLOPs) + every collective at its link (the slowest rank's placement), serial,
    minus what the overlapped latent gather hides behind the query projection."""
    compute = _compute_seconds(summary, cluster.tflops)
    window = None
    if summary.spec.overlap and cfg.cp_size > 1:
        qproj = query_projection_flops(cfg)
        window = qproj / (cluster.tflops * 1e12) if qproj else None
    best = None
    for rank in placement_ranks(cfg, cluster.devices_per_node):
        comm = hidden = 0.0
        intra = inter = 0
        for c in summary.rank0.comm:   # every rank moves the same bytes
            a, b = link_bytes(cfg, c, rank, cluster)
            intra, inter = intra + a, inter + b
            t = collective_seconds(cfg, c, rank, cluster)
            comm += t
            if window is not None and c.tag == "latent":
                hidden += min(t, window if c.direction == "forward" else 2 * window)
        if best is None or comm - hidden > best[0]:
            best = (comm - hidden, comm, hidden, intra, inter, rank)
    _, comm, hidden, intra, inter, rank = best
    return ClusterTime(compute, comm, hidden, compute + comm - hidden, intra, inter, rank)

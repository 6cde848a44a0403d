"""Per-layer fwd+bwd time of the worst rank from FLOPs, bytes and a machine."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .config import Config
from .flops import query_projection_flops
from .summary import RankSummary


@dataclass(frozen=True)
class Machine:
    """Per-rank link bandwidth (GB/s, bytes a rank sends) and effective matmul throughput."""

    name: str
    link_gbps: float
    tflops: float


# Assumptions, not measurements (override with --link-bandwidth / --device-tflops):
# 910B bf16 dense peak is about 320 TFLOPS; 160 assumes ~50% utilization by the
# attention matmuls. Intra-node: 7 HCCS links per NPU in the 8-NPU mesh, about
# 28 GB/s each way per link -> ~196 GB/s a rank can send. Cross-node: one
# 200 Gb/s RoCE NIC per NPU -> 25 GB/s.
MACHINES = {
    "910b-intra-node": Machine("910b-intra-node", 196.0, 160.0),
    "910b-cross-node": Machine("910b-cross-node", 25.0, 160.0),
}


@dataclass(frozen=True)
class TimeEstimate:
    compute_s: float
    comm_s: float
    hidden_s: float     # latent gather time hidden behind the query projection (overlap)
    total_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def estimate_seconds(cfg: Config, summary: RankSummary, machine: Machine) -> TimeEstimate:
    """Per-layer fwd+bwd time of the worst rank: compute + wire bytes / bandwidth, serial,
    minus what the overlapped latent gather hides behind the query projection.

    Attention FLOPs: causal-visible pairs for the fused kernel of the non-recomputing
    forms, executed rectangles for the blockwise path."""
    f = summary.flops_worst
    attn = f.attention_fwd + f.attention_bwd
    if not summary.spec.recompute_kv:
        # A fused causal kernel skips fully masked tiles: count visible pairs. The
        # blockwise path hands each block's full rectangle (explicit mask) to its kernel.
        attn *= f.attention_visible_fwd / f.attention_fwd
    compute = (attn + f.rebuild_fwd + f.rebuild_bwd) / (machine.tflops * 1e12)
    wire = summary.comm_bytes("forward", "wire") + summary.comm_bytes("backward", "wire")
    comm = wire / (machine.link_gbps * 1e9)
    hidden = 0.0
    if summary.spec.overlap and cfg.cp_size > 1:
        qproj = query_projection_flops(cfg)
        if qproj:
            window_fwd = qproj / (machine.tflops * 1e12)
            for c in summary.rank0.comm:
                if c.tag == "latent":
                    hidden += min(c.wire / (machine.link_gbps * 1e9),
                                  window_fwd if c.direction == "forward" else 2 * window_fwd)
    return TimeEstimate(compute, comm, hidden, compute + comm - hidden)

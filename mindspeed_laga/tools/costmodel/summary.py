"""One variant's costs at one rank (:class:`FormCost`) and over the CP group
(:class:`RankSummary`: rank 0, the rank average and the worst rank), costed once per
(config, variant) and, past ``EXACT_RANKS``, on a sample of ranks."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from typing import Dict, List, Optional

from ..runspec import RunSpec
from ...vocab.names import FORMS
from .comm import Collective, collectives
from .config import BLOCKWISE, Config, model_kernel_kind
from .flops import Flops, flops
from .geometry import block_keys
from .memory import Term, saved_terms
from .peak import peak_terms

MEASURES = ("payload", "wire", "design")


@dataclass
class FormCost:
    variant: str
    form: str
    rank: int
    kernel: str                      # the resolved kernel kind
    comm: List[Collective]
    saved: List[Term]
    flops: Dict[str, int]            # Flops.as_dict(): attention_fwd, ..., rebuild_bwd
    kv_transient_bytes: int = 0      # K/V a recomputing LAGA holds at once (not saved)
    peak: List[Term] = field(default_factory=list)  # peak.peak_terms: saved + output + transient

    def comm_bytes(self, direction: Optional[str] = None, measure: str = "payload") -> float:
        return sum(getattr(c, measure) for c in self.comm
                   if direction is None or c.direction == direction)

    @property
    def saved_bytes(self) -> int:
        return sum(t.bytes for t in self.saved)

    @property
    def peak_bytes(self) -> int:
        """Predicted peak memory of the call above its inputs (``peak`` terms summed)."""
        return sum(t.bytes for t in self.peak)

    @property
    def flop_counts(self) -> Flops:
        return Flops(**self.flops)


def kernel_kind(cfg: Config, spec: RunSpec) -> str:
    """The kernel kind ``spec`` runs with: blockwise when recomputing, else the config's."""
    if spec.recompute_kv:
        return BLOCKWISE
    d = cfg.dims
    qk, vd = (d.latent_dim, d.kv_lora_rank) if spec.form == "absorbed" else (d.qk_dim, d.v_head_dim)
    return model_kernel_kind(cfg.kernel, qk, vd, cfg.documents is not None)


def form_cost(cfg: Config, variant: RunSpec, rank: int = 0) -> FormCost:
    """Everything about one variant on one CP rank."""
    if variant.form not in FORMS:
        raise ValueError(f"form {variant.form!r} is unknown; use one of {FORMS}")
    kind = kernel_kind(cfg, variant)
    transient = 0
    if variant.recompute_kv:
        d = cfg.dims
        transient = (block_keys(cfg, rank, variant) * cfg.micro_batch * cfg.attended_heads
                     * (d.qk_dim + d.qk_head_dim + d.v_head_dim) * cfg.elem)
    return FormCost(variant.name, variant.form, rank, kind, collectives(cfg, variant.form),
                    saved_terms(cfg, rank, kind, variant), flops(cfg, rank, kind, variant).as_dict(),
                    transient, peak_terms(cfg, rank, kind, variant))


@dataclass(frozen=True)
class RankSummary:
    """Rank 0's costs plus the rank average and worst rank of saved bytes and FLOPs."""

    spec: RunSpec
    rank0: FormCost
    saved_average: float
    saved_worst: int
    saved_worst_rank: int
    flops_average: Dict[str, float]
    flops_worst: Flops
    kv_transient_bytes: int
    peak_worst: int = 0
    peak_worst_rank: int = 0
    ranks_costed: int = 0            # < the CP size: a sample of ranks (sampled_ranks)

    def comm_bytes(self, direction: Optional[str] = None, measure: str = "payload") -> float:
        """Rank 0's bytes (every rank moves the same)."""
        return self.rank0.comm_bytes(direction, measure)

    def as_dict(self) -> dict:
        first = self.rank0
        return {
            "variant": self.spec.name, "form": self.spec.form, "kernel": first.kernel,
            "options": self.spec.options(), "overlap": self.spec.overlap,
            "comm": {
                "forward": {m: first.comm_bytes("forward", m) for m in MEASURES},
                "backward": {m: first.comm_bytes("backward", m) for m in MEASURES},
                "collectives": [asdict(c) for c in first.comm],
                "wire_by_group": comm_by_group(first),
            },
            "saved_bytes": {"rank0": first.saved_bytes, "average": self.saved_average,
                            "worst": self.saved_worst, "worst_rank": self.saved_worst_rank},
            "saved_terms_rank0": [asdict(t) for t in first.saved],
            "flops": {k: {"rank0": first.flops[k], "average": self.flops_average[k],
                          "worst": getattr(self.flops_worst, k)} for k in first.flops},
            "kv_transient_bytes": self.kv_transient_bytes,
            "peak_bytes": {"rank0": first.peak_bytes, "worst": self.peak_worst,
                           "worst_rank": self.peak_worst_rank},
            "peak_terms_rank0": [asdict(t) for t in first.peak],
            "ranks_costed": self.ranks_costed,
        }


# Up to this CP size every rank is costed; past it a sample (``sampled_ranks``) stands for
# the group, so a plan at any CP costs the same few ranks.
EXACT_RANKS = 32
EDGE_RANKS = 8      # the first and last ranks of a sample: the causal split's extremes
SPREAD_RANKS = 16   # evenly spaced ranks of a sample: its averages


def sampled_ranks(cp_size: int):
    """(ranks costed, ranks averaged): every rank up to EXACT_RANKS; past it the first and
    last EDGE_RANKS (where the contiguous and zigzag splits put the most and the fewest
    keys) plus SPREAD_RANKS evenly spaced ranks, whose mean is the average."""
    if cp_size <= EXACT_RANKS:
        every = list(range(cp_size))
        return every, every
    spread = sorted({round(i * (cp_size - 1) / (SPREAD_RANKS - 1)) for i in range(SPREAD_RANKS)})
    edges = set(range(EDGE_RANKS)) | set(range(cp_size - EDGE_RANKS, cp_size))
    return sorted(edges | set(spread)), spread


@lru_cache(maxsize=512)
def summarize(cfg: Config, spec: RunSpec) -> RankSummary:
    """The group's figures, once per (config, variant): the tables, the times and the
    recommendation ask for the same ones."""
    ranks, averaged = sampled_ranks(cfg.cp_size)
    by_rank = {r: form_cost(cfg, spec, r) for r in ranks}
    costs = list(by_rank.values())
    mean = [by_rank[r] for r in averaged]
    worst = max(costs, key=lambda c: (c.saved_bytes, sum(c.flops.values())))
    keys = [f.name for f in fields(Flops)]
    return RankSummary(
        spec=spec, rank0=costs[0],
        saved_average=sum(c.saved_bytes for c in mean) / len(mean),
        saved_worst=max(c.saved_bytes for c in costs), saved_worst_rank=worst.rank,
        flops_average={k: sum(c.flops[k] for c in mean) / len(mean) for k in keys},
        flops_worst=Flops(**{k: max(c.flops[k] for c in costs) for k in keys}),
        kv_transient_bytes=max(c.kv_transient_bytes for c in costs),
        peak_worst=max(c.peak_bytes for c in costs),
        peak_worst_rank=max(costs, key=lambda c: c.peak_bytes).rank,
        ranks_costed=len(ranks))


def rank_summary(cfg: Config, variant: RunSpec) -> dict:
    """:func:`summarize` as JSON-able dict (what ``plan --json`` prints per variant)."""
    return summarize(cfg, variant).as_dict()


def comm_by_group(cost: FormCost, measure: str = "wire") -> Dict[str, float]:
    """fwd+bwd bytes per group ("cp"; hybrid: "ulysses" and "cp" or "ring")."""
    out: Dict[str, float] = {}
    for c in cost.comm:
        out[c.group] = out.get(c.group, 0) + getattr(c, measure)
    return out


def config_summary(cfg: Config) -> dict:
    d = cfg.dims
    return {"heads": d.heads, "qk_head_dim": d.qk_head_dim, "qk_pos_emb_head_dim": d.rope_dim,
            "v_head_dim": d.v_head_dim, "kv_lora_rank": d.kv_lora_rank, "hidden_size": d.hidden_size,
            "q_lora_rank": d.q_lora_rank, "seq_len": cfg.seq_len, "micro_batch": cfg.micro_batch,
            "cp_size": cfg.cp_size, "tp_size": cfg.tp_size, "cp_algo": cfg.cp_algo,
            "layout": cfg.seq_layout, "dtype": cfg.dtype, "kernel": cfg.kernel, "causal": cfg.causal,
            "doc_lens": list(cfg.doc_lens) if cfg.doc_lens else None,
            "ulysses_degree": cfg.ulysses_degree}

"""``plan``'s figures as one JSON-able dict: the tables' rows per kernel and algorithm, the
trade-off notes, the fit check, the time tables and the one recommendation."""
from __future__ import annotations

from dataclasses import asdict, replace
from typing import Dict, List

from .. import costmodel as cm
from ..runspec import standard_runs
from ...cp_algos import algo
from ...kernels.registry import model_kind
from ...vocab.names import CP_ALGOS, HYBRID
from .output import GiB
from . import recommend
from .plan_args import (DEVICE_TYPE, DIM_FLAGS, at, base_config, cluster_from_args, kernels_from_args,
                        machines_from_args, node_table_wanted, requested, table_configs)


def build_plan(args) -> dict:
    """Everything the tables show, as one JSON-able dict."""
    base = base_config(args)
    asked = requested(args)
    if asked:
        table_configs(args, base, asked)  # an algorithm asked for that cannot run: its error first
    variants = standard_runs(min(args.kv_block_size, args.seq_len))
    kernels = kernels_from_args(args)
    one_link = asked or [(a, 1) for a in CP_ALGOS] + (
        [(HYBRID, args.ulysses_degree)] if args.ulysses_degree else [])
    times = time_estimates(base, variants, machines_from_args(args), one_link)
    nodes = (node_estimates(base, variants, cluster_from_args(args), asked, args.ulysses_degree)
             if node_table_wanted(args) else None)
    rec = recommendation(args, base, variants, asked or one_link, nodes)
    best = rec["best"]["cfg"]
    configs = table_configs(args, base, asked or [(best.cp_algo, best.ulysses_degree)])
    plan = {"config": cm.config_summary(configs[0]), "units": {
        "bytes": "per layer, per CP rank", "flops": "per layer, per CP rank (worst rank)",
        "comm_design": "payload*(P-1)/P (the paper's convention; docs/DESIGN.md, section 'Communication')",
        "comm_wire": "bytes this rank sends (ring all-gather/reduce-scatter: (P-1) shards)"},
        "algos": {}}
    plan["config"]["cp_algo"] = [c.cp_algo for c in configs]
    for cfg in configs:
        per_kernel = {k: {v.name: cm.rank_summary(replace(cfg, kernel=model_kind(k, DEVICE_TYPE)), v)
                          for v in variants} for k in kernels}
        plan["algos"][cfg.cp_algo] = {"layout": cfg.seq_layout, "ulysses_degree": cfg.ulysses_degree,
                                      "kernels": per_kernel,
                                      "notes": trade_off_notes(per_kernel[kernels[-1]])}
        if args.device_memory is not None:
            plan["algos"][cfg.cp_algo]["fit"] = fit_check(per_kernel, args.device_memory, args.num_layers)
    plan["time"] = times
    plan["cp_defaulted"] = args.cp_defaulted
    plan["preset"] = args.preset
    plan["dims_flagged"] = any(getattr(args, d.dest) is not None for d in DIM_FLAGS)
    if nodes is not None:
        plan["nodes"] = nodes
    plan["recommendation"] = recommend.as_json(rec)
    plan["recommendation_rows"] = rec  # for printing; dropped from --json
    return plan


def recommendation(args, base: cm.Config, variants, settings: List[tuple], nodes) -> dict:
    """The one answer, timed on the node table when shown, else on the one-link table of the
    link the ranks use (custom, or 910B inside a node when CP fits one, else across nodes)."""
    if nodes is not None:
        cluster = cluster_from_args(args)
        settings = [(r["cp_algo"], r["ulysses_degree"]) for r in nodes["rows"] if "error" not in r]
        basis = (f"the node table: nodes of {cluster.devices_per_node}, intra-node "
                 f"{cluster.intra_gbps:g} GB/s, inter-node {cluster.inter_gbps:g} GB/s")

        def timer(c, summary):
            return cm.estimate_cluster_seconds(c, summary, cluster)
    else:
        machines = machines_from_args(args)
        per_node = cm.CLUSTERS["910b"].devices_per_node
        machine = machines[0] if len(machines) == 1 or args.cp <= per_node else machines[1]
        nodes = -(-args.cp // per_node)
        spans = "" if machine.name == "custom" else (
            f", CP={args.cp} fits one 910B node of {per_node}" if nodes == 1
            else f", CP={args.cp} spans {nodes} 910B nodes of {per_node}")
        basis = f"the {machine.name} table: {machine.link_gbps:g} GB/s per rank{spans}"

        def timer(c, summary):
            return cm.estimate_seconds(c, summary, machine)
    candidates = []
    for name, degree in dict.fromkeys(settings):
        cfg = at(base, name, degree)
        try:
            recommend.validate(cfg)
        except ValueError:
            continue  # the time tables say why it is n/a
        candidates.append(cfg)
    if not candidates:
        recommend.validate(at(base, *settings[0]))  # raises the first algorithm's reason
    device = args.device_memory * GiB if args.device_memory is not None else None
    return recommend.recommend(candidates, variants, timer, basis, device, args.num_layers)


def trade_off_notes(rows: Dict[str, dict]) -> Dict[str, float]:
    """The allgather trade-offs of docs/DESIGN.md, sections 'Memory' and 'FLOPs', as numbers (fused kernel rows unless only eager)."""
    ex, ab, la = rows["explicit"], rows["absorbed"], rows["laga"]

    def comm(r):
        return r["comm"]["forward"]["design"] + r["comm"]["backward"]["design"]

    def wire(r):
        return r["comm"]["forward"]["wire"] + r["comm"]["backward"]["wire"]

    def saved(r):
        return r["saved_bytes"]["worst"]

    def fl(r, key, which="worst"):
        return r["flops"][key][which]

    def div(a, b):  # None where there is nothing to compare (no CP: no bytes)
        return a / b if b else None

    notes = {
        "comm_explicit_over_laga_design": div(comm(ex), comm(la)),
        "comm_explicit_over_laga_wire": div(wire(ex), wire(la)),
        "saved_absorbed_over_explicit": div(saved(ab), saved(ex)),
        "saved_laga_over_explicit": div(saved(la), saved(ex)),
        "attention_flops_absorbed_over_explicit": fl(ab, "attention_fwd") / fl(ex, "attention_fwd"),
        "rebuild_flops_laga_over_explicit": fl(la, "rebuild_fwd") / fl(ex, "rebuild_fwd"),
        "extra_rebuild_over_visible_attention": (fl(la, "rebuild_fwd") - fl(ex, "rebuild_fwd"))
        / fl(ex, "attention_visible_fwd"),
    }
    if "laga+trim" in rows:
        notes["rebuild_flops_laga_trim_over_explicit_average"] = (
            fl(rows["laga+trim"], "rebuild_fwd", "average") / fl(ex, "rebuild_fwd", "average"))
        notes["rebuild_flops_laga_trim_over_explicit_worst"] = (
            fl(rows["laga+trim"], "rebuild_fwd") / fl(ex, "rebuild_fwd"))
    for name in ("laga+blockwise", "laga+recompute"):
        if name in rows:
            r = rows[name]
            notes[f"saved_{name}_over_explicit"] = saved(r) / saved(ex)
            notes[f"saved_{name}_over_absorbed"] = saved(r) / saved(ab)
            notes[f"rebuild_flops_fwd_bwd_{name}_over_laga"] = (
                (fl(r, "rebuild_fwd") + fl(r, "rebuild_bwd")) / (fl(la, "rebuild_fwd") + fl(la, "rebuild_bwd")))
    return notes


def fit_check(per_kernel: Dict[str, Dict[str, dict]], device_gib: float, layers: int) -> dict:
    out = {}
    for kernel, rows in per_kernel.items():
        for name, r in rows.items():
            need = r["saved_bytes"]["worst"] * layers
            out.setdefault(kernel, {})[name] = {"bytes": need, "fraction": need / (device_gib * GiB),
                                                "fits": need <= device_gib * GiB}
    return out


def time_estimates(cfg: cm.Config, variants, machines, settings: List[tuple]) -> dict:
    """Per-layer fwd+bwd seconds for every form under each (cp_algo, U) of ``settings``
    (fused kernel), fastest named."""
    out = {}
    degree = next((u for a, u in settings if algo(a).takes_ulysses_degree), None)
    for machine in machines:
        rows = {}
        for name, u in settings:
            c = replace(cfg, cp_algo=name, layout=None, kernel=cm.FUSED, ulysses_degree=u)
            try:
                recommend.validate(c)
            except ValueError as exc:
                rows[name] = {"error": str(exc)}
                continue
            rows[name] = {v.name: cm.estimate_seconds(c, cm.summarize(c, v), machine).as_dict()
                          for v in variants}
        timed = [(t["total_s"], a, v) for a, r in rows.items() if "error" not in r
                 for v, t in r.items()]
        best = min(timed) if timed else None
        out[machine.name] = {"link_gbps": machine.link_gbps, "tflops": machine.tflops, "rows": rows,
                             "ulysses_degree": degree,
                             "fastest": {"cp_algo": best[1], "variant": best[2], "seconds": best[0]}
                             if best else None}
    return out


def node_candidates(cfg: cm.Config, asked: List[tuple], degree) -> List[cm.Config]:
    """The (cp_algo, U) pairs asked for; when none are: allgather, ulysses and hybrid (the
    given U, else every U with 1 < U < P)."""
    if asked:
        return [at(cfg, a, u) for a, u in asked]
    degrees = [degree] if degree is not None else [u for u in range(2, cfg.cp_size) if cfg.cp_size % u == 0]
    return [at(cfg, a, 1) for a in CP_ALGOS] + [at(cfg, HYBRID, u) for u in degrees]


def node_estimates(cfg: cm.Config, variants, cluster: cm.Cluster, asked: List[tuple], degree=None) -> dict:
    """Per-layer fwd+bwd time of every variant under each CP algorithm (and U) on nodes with
    two links; the fastest (variant, cp_algo, U) named."""
    rows = []
    for c in node_candidates(cfg, asked, degree):
        label = {"cp_algo": c.cp_algo, "ulysses_degree": c.ulysses_degree}
        try:
            recommend.validate(c)
        except ValueError as exc:
            if c.algo.takes_ulysses_degree and degree is not None:
                raise
            rows.append({**label, "error": str(exc)})
            continue
        spans = c.algo.takes_ulysses_degree and not cm.ulysses_fits_node(c, cluster.devices_per_node)
        for v in variants:
            t = cm.estimate_cluster_seconds(c, cm.summarize(c, v), cluster)
            rows.append({**label, "variant": v.name, "ulysses_spans_nodes": spans, **t.as_dict()})
    timed = [r for r in rows if "error" not in r]
    best = min(timed, key=lambda r: r["total_s"]) if timed else None
    return {"cluster": asdict(cluster), "rows": rows,
            "fastest": {k: best[k] for k in ("variant", "cp_algo", "ulysses_degree", "total_s")}
            if best else None}

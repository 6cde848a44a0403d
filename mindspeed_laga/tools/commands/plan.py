"""``mindspeed-laga plan``: the cost model's table for one configuration.

Per layer and per CP rank, for every form and LAGA option: collective bytes
(the paper's payload*(P-1)/P and the wire bytes a rank sends), activation
bytes saved for backward by the attention block (eager and sdpa kernels),
attention and K/V-rebuild FLOPs, each beside explicit. With --device-memory
and --num-layers: whether each form's attention activations fit. With the
910B link/throughput defaults (or yours): an estimated per-layer time for
every form and cp_algo. With --npus-per-node (or --ulysses-degree): hybrid CP
beside allgather and ulysses on nodes with an intra-node and an inter-node
link (--cp defaults to two nodes' worth there, so the inter-node link carries
traffic). Ends with one recommendation: the CP algorithm (and U) and LAGA
options, with their training flags, what they save against the host's
explicit path and why. Nothing runs; see ``mindspeed-laga bench`` for
measurements.
"""
from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, replace
from typing import Dict, List

from .. import costmodel as cm
from ..runspec import standard_runs
from ...cp_algos import algo, takes_ulysses_degree
from ...kernels.registry import CPU_KERNELS, KERNEL_NAMES, canonical, model_kind
from ...vocab.names import CP_ALGOS, HYBRID, LAYOUTS
from ...vocab.dims import ModelDims
from .output import GiB, MiB, dtype_arg, finite_float, fmt_bytes as _fmt_bytes, ratio as _ratio
from . import plan_dsa
from . import recommend
from .parsers import add_cp_algo_args, command_parser
from .shapes import HEAD_DIMS, SizeFlag, check_seq_len_bound

KERNEL_CHOICES = KERNEL_NAMES + ("both",)
# plan models accelerator ranks: a kernel's cost-model kind there (torch SDPA: flash-style)
DEVICE_TYPE = "accelerator"
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}
# The dim flags: the head dims every command shares, with DeepSeek-V3's values, then the two
# only plan models.
DEEPSEEK_V3_NOTES = {"heads": "(DeepSeek-V3: 128)", "qk_head_dim": "(128)", "rope_dim": "(64)",
                     "v_head_dim": "(128)",
                     "kv_lora_rank": "(512); the gathered latent is d_c + d_r a token"}
DIM_FLAGS = tuple(d._replace(what=f"{d.what} {DEEPSEEK_V3_NOTES[d.field]}") for d in HEAD_DIMS) + (
    SizeFlag("hidden_size", "hidden_size",
             "model width (7168); sizes the query projection LAGA's overlap hides behind"),
    SizeFlag("q_lora_rank", "q_lora_rank", "query low-rank width (1536)"))
DEFAULT_CP = 8
WIDTH = 100  # every line of the tables fits a 100-column terminal


def add_parser(sub):
    p = command_parser(sub, "plan", "model comm bytes, activation memory, FLOPs and time per form", __doc__)
    p.add_argument("--preset", default="deepseek-v3",
                   help=f"MLA dims: one of {sorted(cm.PRESETS)} (default deepseek-v3); the dim "
                        "flags below override single values")
    g = p.add_argument_group("MLA dims (override the preset)")
    for size in DIM_FLAGS:
        g.add_argument(size.flag, type=int, default=None, help=size.what)
    p.add_argument("--seq-len", type=int, default=16384,
                   help="full sequence length in tokens, before CP splits it (default 16384)")
    p.add_argument("--micro-batch", type=int, default=1,
                   help="sequences per micro-batch, b (default 1)")
    p.add_argument("--cp", type=int, default=None,
                   help=f"context-parallel size (default {DEFAULT_CP}; with the node table, two "
                        "nodes: 2 x --npus-per-node, so traffic crosses nodes)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size: each rank holds n/TP heads (default 1)")
    add_cp_algo_args(p, None, degree_type=int,  # checked with plan's other sizes
                     algo_note=" (default: every algorithm compared, hybrid on the node table, "
                               "and the tables shown for the recommended one; given: only it)",
                     degree_help="hybrid CP: heads split inside groups of U consecutive CP ranks, "
                                 "the latent (explicit: K/V) across them; also the U of the node "
                                 "table's hybrid rows (default there: every U dividing CP)")
    p.add_argument("--layout", choices=LAYOUTS, default=None,
                   help="default: zigzag for allgather, contiguous for ulysses")
    docs = p.add_mutually_exclusive_group()
    docs.add_argument("--doc-lens", default=None, metavar="N,N,...",
                      help="packed documents' lengths, summing to --seq-len (a query sees only "
                           "its own document)")
    docs.add_argument("--num-docs", type=int, default=None, metavar="N",
                      help="N equal documents (N divides --seq-len)")
    p.add_argument("--dtype", type=dtype_arg(("bfloat16", "float16", "float32")), default="bf16",
                   help="bf16 (default), fp16 or fp32 (bfloat16/float16/float32 alike)")
    p.add_argument("--kernel", type=canonical, choices=KERNEL_CHOICES, default="both",
                   help="eager (scores kept), sdpa (flash-style; 'fused' is the same), npu "
                        f"(npu_fusion_attention), both = {' and '.join(CPU_KERNELS)} (default)")
    p.add_argument("--kv-block-size", type=int, default=2048,
                   help="keys per rebuilt block for the blockwise LAGA rows (default 2048)")
    p.add_argument("--device-memory", type=finite_float, default=None, metavar="GiB",
                   help="device memory for the fit check (with --num-layers)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="attention layers held by one device (fit check)")
    p.add_argument("--link-bandwidth", type=finite_float, default=None, metavar="GB/s",
                   help="bytes per second a rank can send (default: 910B intra-node 196 and "
                        "cross-node 25, both shown)")
    p.add_argument("--device-tflops", type=finite_float, default=None,
                   help="effective matmul throughput per device (default 160: ~50%% of 910B bf16 peak)")
    g = p.add_argument_group("nodes (the two-link table: allgather, ulysses and hybrid CP)")
    g.add_argument("--npus-per-node", "--gpus-per-node", dest="devices_per_node", type=int, default=None,
                   metavar="N", help="devices per node (910B: 8); shows the node table")
    g.add_argument("--intra-node-bandwidth", type=finite_float, default=None, metavar="GB/s",
                   help="bytes per second a rank sends inside a node (default 196: 910B HCCS)")
    g.add_argument("--inter-node-bandwidth", type=finite_float, default=None, metavar="GB/s",
                   help="bytes per second a rank sends to other nodes (default 25: 200 Gb/s RoCE)")
    p.add_argument("--terms", action="store_true",
                   help="also list every saved tensor of every variant (rank 0, last kernel)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    plan_dsa.add_args(p)


# ---------------------------------------------------------------- config

def dims_from_args(args) -> ModelDims:
    dims = cm.preset(args.preset)
    changes = {d.field: getattr(args, d.dest) for d in DIM_FLAGS if getattr(args, d.dest) is not None}
    return replace(dims, **changes)


def node_table_wanted(args) -> bool:
    return (args.devices_per_node is not None or args.ulysses_degree is not None
            or takes_ulysses_degree(args.cp_algo))


def resolve_cp(args) -> None:
    """--cp's default: 8, or with the node table two nodes' worth (16 on 8-device nodes):
    inside one node nothing crosses the inter-node link, where hybrid CP gains."""
    args.cp_defaulted = args.cp is None
    if args.cp is None:
        per_node = args.devices_per_node or cm.CLUSTERS["910b"].devices_per_node
        args.cp = 2 * per_node if node_table_wanted(args) and per_node > 0 else DEFAULT_CP


def check_args(args) -> None:
    """One-line errors for the sizes, rates and flag pairs, before any model runs."""
    resolve_cp(args)
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype {args.dtype!r} is unknown; use bf16, fp16 or fp32")
    for flag in ("seq_len", "micro_batch", "cp", "tp", "kv_block_size", "num_layers", "ulysses_degree",
                 "devices_per_node"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            name = "npus-per-node" if flag == "devices_per_node" else flag.replace('_', '-')
            raise ValueError(f"--{name} must be positive, got {value}")
    for flag in ("device_memory", "link_bandwidth", "device_tflops", "intra_node_bandwidth",
                 "inter_node_bandwidth"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    check_seq_len_bound("--seq-len", args.seq_len)
    check_ulysses_degree(args)
    if (args.device_memory is None) != (args.num_layers is None):
        raise ValueError("--device-memory and --num-layers go together (the fit check needs both)")
    if takes_ulysses_degree(args.cp_algo) and args.ulysses_degree is None:
        raise ValueError("--cp-algo hybrid needs --ulysses-degree U (the Ulysses group's size, a "
                         "divisor of --cp)")


def check_ulysses_degree(args) -> None:
    """Hybrid's U as LAGA and MindSpeed accept it: 1 < U < CP (U = 1 is a ring over every rank,
    U = CP is ulysses; both refuse it at start-up), so no hybrid row is one they refuse."""
    u = args.ulysses_degree
    if u is not None and not 1 < u < args.cp:
        other = "--cp-algo ulysses" if u == args.cp else "--cp-algo allgather"
        raise ValueError(f"--ulysses-degree {u} with --cp {args.cp}: hybrid CP needs 1 < U < CP "
                         f"(LAGA and MindSpeed refuse --ulysses-degree-in-cp {u} at start-up); "
                         f"give a U between, or use {other}")


def base_config(args) -> cm.Config:
    """The configuration asked, under the first algorithm asked (ulysses when none is)."""
    check_args(args)
    doc_lens = cm.doc_lens_for(args.seq_len, parse_doc_lens(args.doc_lens), args.num_docs)
    return cm.Config(dims=dims_from_args(args), seq_len=args.seq_len, micro_batch=args.micro_batch,
                     cp_size=args.cp, tp_size=args.tp, cp_algo=CP_ALGOS[-1], layout=args.layout,
                     dtype=DTYPES[args.dtype], kernel=cm.FUSED, doc_lens=doc_lens)


def requested(args) -> List[tuple]:
    """(cp_algo, U) pairs --cp-algo asks for; empty when it is not given (compare them all)."""
    if args.cp_algo is None:
        return []
    names = CP_ALGOS if args.cp_algo == "both" else (args.cp_algo,)
    return [(n, args.ulysses_degree if algo(n).takes_ulysses_degree else 1) for n in names]


def at(cfg: cm.Config, name: str, degree: int, layout=None) -> cm.Config:
    return replace(cfg, cp_algo=name, ulysses_degree=degree, layout=layout)


def table_configs(args, base: cm.Config, chosen: List[tuple]) -> List[cm.Config]:
    """The bytes/memory tables' configurations, each validated (errors name the fix)."""
    out = []
    for name, degree in chosen:
        cfg = at(base, name, degree, args.layout)
        cm.validate(cfg, standard_runs(args.kv_block_size))
        out.append(cfg)
    return out



def parse_doc_lens(text):
    """``--doc-lens 4096,1024,...`` -> a tuple of ints (None when not given)."""
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--doc-lens {text!r} must be comma-separated integers, e.g. 4096,1024")


def machines_from_args(args) -> List[cm.Machine]:
    if args.link_bandwidth is None and args.device_tflops is None:
        return list(cm.MACHINES.values())
    base = cm.MACHINES["910b-intra-node"]
    return [cm.Machine("custom", args.link_bandwidth or base.link_gbps, args.device_tflops or base.tflops)]


# ---------------------------------------------------------------- the plan

def kernels_from_args(args) -> List[str]:
    return list(CPU_KERNELS) if args.kernel == "both" else [args.kernel]


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


def cluster_from_args(args) -> cm.Cluster:
    base = cm.CLUSTERS["910b"]
    cluster = replace(base, intra_gbps=args.intra_node_bandwidth or base.intra_gbps,
                      inter_gbps=args.inter_node_bandwidth or base.inter_gbps,
                      tflops=args.device_tflops or base.tflops,
                      devices_per_node=args.devices_per_node or base.devices_per_node)
    return cluster if cluster == base else replace(cluster, name="custom")


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


# ---------------------------------------------------------------- printing

def _say(text: str, indent: str = "") -> None:
    """A note wrapped to the tables' width."""
    print(textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  "))


def print_plan(plan: dict) -> None:
    c = plan["config"]
    _say(f"plan: n={c['heads']} d_n={c['qk_head_dim']} d_r={c['qk_pos_emb_head_dim']} "
         f"d_v={c['v_head_dim']} d_c={c['kv_lora_rank']}, S={c['seq_len']}, b={c['micro_batch']}, "
         f"CP={c['cp_size']}, TP={c['tp_size']}, {c['dtype']}; per layer and per CP rank (model)")
    if plan.get("cp_defaulted") and "nodes" in plan:
        per_node = plan["nodes"]["cluster"]["devices_per_node"]
        _say(f"CP={c['cp_size']}: the default with the node table, two nodes of {per_node}, so "
             "traffic crosses the inter-node link (where hybrid CP gains); --cp sets it")
    if c.get("doc_lens"):
        lens = c["doc_lens"]
        shown = ",".join(map(str, lens)) if len(lens) <= 8 else f"{len(lens)} documents"
        print(f"documents: {shown} (a query sees only its own document)")
    for algo, entry in plan["algos"].items():
        hybrid = f", U={entry['ulysses_degree']}" if takes_ulysses_degree(algo) else ""
        print(f"\ncp_algo={algo} (layout {entry['layout']}{hybrid})")
        _print_comm_flops(entry, algo)
        _print_memory(entry, algo)
        kernels = list(entry["kernels"])
        _print_notes(entry["notes"], kernels[-1])
        if plan.get("show_terms"):
            _print_terms(entry["kernels"][kernels[-1]], kernels[-1])
        if "fit" in entry:
            _print_fit(entry["fit"])
    _print_times(plan["time"])
    if "nodes" in plan:
        _print_nodes(plan["nodes"])
    print()
    _say("saved: activation bytes autograd keeps inside the attention call, worst CP rank "
         "(kv_up_weight excluded); peak: predicted peak memory of the call above its inputs (saved + "
         "output + the largest transient: kernel workspace, backward buffers or the blockwise "
         "block and accumulators; an estimate, `--terms` names them); FLOPs: the last kernel's, "
         "attention as executed (masked keys of each segment's key window included), worst rank "
         "unless 'rank avg'; `--json` has every term, rank averages included.")
    sampled = _ranks_costed(plan)
    if sampled < c["cp_size"]:
        _say(f"CP={c['cp_size']}: the per-rank figures come from {sampled} of the {c['cp_size']} ranks "
             "(the first and last 8, where the causal split's extremes lie, and 16 evenly spaced, "
             "whose mean is the rank average)")
    recommend.print_recommendation(plan["recommendation_rows"], _fmt_bytes, WIDTH)


def _ranks_costed(plan: dict) -> int:
    return min(r["ranks_costed"] for entry in plan["algos"].values()
               for rows in entry["kernels"].values() for r in rows.values())


def _trimmed_of(name: str) -> str:
    """The variant a '+trim' variant trims ('laga+blockwise+trim' -> 'laga+blockwise')."""
    return name.replace("+trim", "")


def _print_rows(cells: Dict[str, str], algo: str) -> None:
    """One line per variant; a '+trim' variant equal to its untrimmed twin in every cell
    says so instead of repeating the figures."""
    for name, line in cells.items():
        base = _trimmed_of(name)
        if name != base and cells.get(base) == line:
            why = "every rank sees every key" if algo == "ulysses" else "its worst rank sees every key"
            print(f"{name:<20} = {base} in every column ({why})")
        else:
            print(f"{name:<20} {line}")


def _print_comm_flops(entry: dict, algo: str) -> None:
    kernels = list(entry["kernels"])
    rows = entry["kernels"][kernels[0]]
    ex = rows["explicit"]
    print(f"{'bytes and FLOPs':<20} {'comm fwd+bwd':>12} {'explicit/':>9} {'wire fwd+bwd':>12} "
          f"{'explicit/':>9} {'attn TFLOP':>10} {'rebuild':>10} {'rebuild':>10}")
    print(f"{'':<20} {'(design)':>12} {'form':>9} {'(sent)':>12} {'form':>9} {'fwd+bwd':>10} "
          f"{'TFLOP':>10} {'rank avg':>10}")
    print("-" * 98)
    ex_comm = ex["comm"]["forward"]["design"] + ex["comm"]["backward"]["design"]
    ex_wire = ex["comm"]["forward"]["wire"] + ex["comm"]["backward"]["wire"]
    cells = {}
    for name, r in rows.items():
        comm = r["comm"]["forward"]["design"] + r["comm"]["backward"]["design"]
        wire = r["comm"]["forward"]["wire"] + r["comm"]["backward"]["wire"]
        f = entry["kernels"][kernels[-1]][name]["flops"]
        attn = (f["attention_fwd"]["worst"] + f["attention_bwd"]["worst"]) / 1e12
        reb = (f["rebuild_fwd"]["worst"] + f["rebuild_bwd"]["worst"]) / 1e12
        avg = (f["rebuild_fwd"]["average"] + f["rebuild_bwd"]["average"]) / 1e12
        cells[name] = (f"{_fmt_bytes(comm):>12} {_ratio(ex_comm, comm):>9} {_fmt_bytes(wire):>12} "
                       f"{_ratio(ex_wire, wire):>9} {attn:>10.3f} {reb:>10.3f} {avg:>10.3f}")
    _print_rows(cells, algo)


MEMORY_COLUMNS = 36  # one kernel's saved, form/expl and peak columns in the memory table


def _kernel_groups(per_kernel: Dict[str, dict]) -> Dict[str, List[str]]:
    """{shown kernel: the kernels after it with the same figures (the same cost-model
    kind)}: a kernel that differs in nothing gets no columns of its own."""
    groups: Dict[str, List[str]] = {}
    for k, rows in per_kernel.items():
        same = next((g for g in groups if per_kernel[g] == rows), None)
        groups.setdefault(k, []) if same is None else groups[same].append(k)
    return groups


def _print_memory(entry: dict, algo: str) -> None:
    """Per kernel the memory columns, as many kernels a block as fit WIDTH (a block per
    line of kernels: any number of registered kernels stays within the terminal)."""
    groups = _kernel_groups(entry["kernels"])
    shown = list(groups)
    per_block = max(1, (WIDTH - 20) // MEMORY_COLUMNS)
    for start in range(0, len(shown), per_block):
        _print_memory_block(entry, algo, shown[start:start + per_block])
    for k, same in groups.items():
        if same:
            _say(f"{', '.join(same)} = {k} in every memory column (the same cost-model kind)", "  ")


def _print_memory_block(entry: dict, algo: str, kernels: List[str]) -> None:
    print()
    print(f"{'memory':<20}" + "".join(f" {('saved ' + k)[:12]:>12} {'form/expl':>9} "
                                      f"{('peak ' + k)[:12]:>12}" for k in kernels))
    print(f"{'':<20}" + "".join(f" {'(worst rank)':>12} {'':>9} {'(worst rank)':>12}" for _ in kernels))
    print("-" * (20 + MEMORY_COLUMNS * len(kernels)))
    cells = {}
    for name in entry["kernels"][kernels[0]]:
        line = []
        for k in kernels:
            saved = entry["kernels"][k][name]["saved_bytes"]["worst"]
            base = entry["kernels"][k]["explicit"]["saved_bytes"]["worst"]
            peak = entry["kernels"][k][name]["peak_bytes"]["worst"]
            line.append(f"{_fmt_bytes(saved):>12} {_ratio(saved, base):>9} {_fmt_bytes(peak):>12}")
        cells[name] = " ".join(line)
    _print_rows(cells, algo)


def _x(value) -> str:
    return "n/a (no CP)" if value is None else f"{value:.2f}x"


def _print_notes(n: dict, kernel: str) -> None:
    _say(f"trade-offs ({kernel} kernel): comm explicit/LAGA {_x(n['comm_explicit_over_laga_design'])} "
         f"(design), {_x(n['comm_explicit_over_laga_wire'])} (wire); saved absorbed/explicit "
         f"{n['saved_absorbed_over_explicit']:.2f}x, LAGA/explicit {n['saved_laga_over_explicit']:.2f}x; "
         f"absorbed attention FLOPs {n['attention_flops_absorbed_over_explicit']:.2f}x explicit; "
         f"LAGA rebuild FLOPs {n['rebuild_flops_laga_over_explicit']:.2f}x explicit "
         f"(extra = {100 * n['extra_rebuild_over_visible_attention']:.0f}% of causal attention FLOPs)",
         "  ")
    if n["extra_rebuild_over_visible_attention"] > 0.005:
        _say("  rebuild extra: each rank rebuilds K/V for every gathered key where explicit rebuilds "
             "only its own 1/CP and gathers the rest; it is set against the attention FLOPs of the "
             "pairs a query sees, which documents cut (a query sees only its own document: about "
             "1/N of the causal sequence's with N equal documents) while the rebuild stays, so the "
             "share grows with the number of documents; laga+trim rebuilds only the keys a rank's "
             "queries see", "  ")
    if "rebuild_flops_laga_trim_over_explicit_average" in n:
        _say(f"prefix trimming: rebuild {n['rebuild_flops_laga_trim_over_explicit_average']:.2f}x "
             f"explicit on the rank average, {n['rebuild_flops_laga_trim_over_explicit_worst']:.2f}x "
             "on the worst rank", "  ")
    for name in ("laga+blockwise", "laga+recompute"):
        if f"saved_{name}_over_explicit" in n:
            _say(f"{name}: saved {n[f'saved_{name}_over_explicit']:.2f}x explicit, "
                 f"{n[f'saved_{name}_over_absorbed']:.2f}x absorbed; rebuild FLOPs (fwd+bwd) "
                 f"{n[f'rebuild_flops_fwd_bwd_{name}_over_laga']:.2f}x LAGA's", "  ")


def _print_terms(rows: Dict[str, dict], kernel: str) -> None:
    print(f"  saved tensors, rank 0, {kernel} kernel (MiB):")
    for name, r in rows.items():
        cells = "; ".join(f"{t['name']} {t['bytes'] / MiB:.1f}" for t in r["saved_terms_rank0"])
        _say(f"{name}: {cells}", "    ")
    print(f"  peak terms, rank 0, {kernel} kernel (MiB):")
    for name, r in rows.items():
        cells = " + ".join(f"{t['name']} {t['bytes'] / MiB:.1f}" for t in r["peak_terms_rank0"])
        _say(f"{name}: {cells}", "    ")


def _print_fit(fit: dict) -> None:
    for kernel, rows in fit.items():
        cells = ", ".join(f"{name} {'fits' if r['fits'] else 'DOES NOT FIT'} ({100 * r['fraction']:.0f}%)"
                          for name, r in rows.items())
        _say(f"fit ({kernel}): {cells}", "  ")


def _print_times(times: dict) -> None:
    for name, m in times.items():
        print()
        _say(f"estimated per-layer fwd+bwd time in ms, {name} (link {m['link_gbps']:g} GB/s per rank, "
             f"{m['tflops']:g} TFLOPS effective, sdpa kernel, worst rank; serial compute + comm, "
             "minus what the overlapped latent gather hides behind the query projection):")
        algos = list(m["rows"])
        label = {a: f"hybrid U={m.get('ulysses_degree')}" if takes_ulysses_degree(a) else a for a in algos}
        timed = [a for a in algos if "error" not in m["rows"][a]]
        variants = list(dict.fromkeys(v for a in timed for v in m["rows"][a]))
        per_block = max(1, (WIDTH - 22) // 13)  # as many algorithm columns as fit WIDTH
        for start in range(0, len(timed), per_block):
            block = timed[start:start + per_block]
            print(f"  {'variant':<20}" + "".join(f" {label[a]:>12}" for a in block))
            for v in variants:
                print(f"  {v:<20}" + "".join(f" {1e3 * m['rows'][a][v]['total_s']:>12.2f}"
                                             for a in block))
        for a in algos:
            if a not in timed:
                _say(f"{label[a]}: n/a: {m['rows'][a]['error']}", "  ")


def _algo_label(r: dict) -> str:
    return f"hybrid U={r['ulysses_degree']}" if takes_ulysses_degree(r["cp_algo"]) else r["cp_algo"]


def _print_nodes(nodes: dict) -> None:
    c = nodes["cluster"]
    print()
    _say(f"estimated per-layer fwd+bwd time on nodes of {c['devices_per_node']} devices ({c['name']}: "
         f"intra-node {c['intra_gbps']:g} GB/s, inter-node {c['inter_gbps']:g} GB/s per rank, "
         f"{c['tflops']:g} TFLOPS effective; sdpa kernel, worst rank; a group inside a node runs at the "
         "intra-node link, an all-to-all across nodes sends to its node's peers intra-node and to the "
         "rest inter-node, a gather across nodes runs at the inter-node link):")
    head = (f"  {'cp_algo':<14} {'variant':<20} {'ms':>9} {'compute':>9} {'comm':>8} "
            f"{'intra GiB':>10} {'inter GiB':>10}")
    print(head)
    print("  " + "-" * (len(head) - 2))
    for r in nodes["rows"]:
        if "error" in r:
            _say(f"{_algo_label(r):<14} n/a: {r['error']}", "  ")
            continue
        print(f"  {_algo_label(r):<14} {r['variant']:<20} {1e3 * r['total_s']:>9.2f} "
              f"{1e3 * r['compute_s']:>9.2f} {1e3 * (r['comm_s'] - r['hidden_s']):>8.2f} "
              f"{r['intra_bytes'] / GiB:>10.3f} {r['inter_bytes'] / GiB:>10.3f}")
    spanning = sorted({r["ulysses_degree"] for r in nodes["rows"] if r.get("ulysses_spans_nodes")})
    for u in spanning:
        _say(f"note: U={u} does not fit in a node of {c['devices_per_node']} devices: its all-to-alls "
             "cross nodes (inter-node link for the remote peers)", "  ")
    timed = [r for r in nodes["rows"] if "error" not in r]
    if timed and not any(r["inter_bytes"] for r in timed):
        _say(f"note: every CP rank shares one node of {c['devices_per_node']}: nothing crosses the "
             "inter-node link, where hybrid CP gains; a --cp over two nodes shows it", "  ")


def run(args) -> int:
    if plan_dsa.wanted(args):
        return plan_dsa.run(args, DIM_FLAGS, DTYPES, DEFAULT_CP)
    plan = build_plan(args)
    plan["show_terms"] = bool(args.terms)
    if args.json:
        print(json.dumps({k: v for k, v in plan.items() if k != "recommendation_rows"}, indent=1))
    else:
        print_plan(plan)
    return 0

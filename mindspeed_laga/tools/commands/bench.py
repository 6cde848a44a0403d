"""``mindspeed-laga bench``: the forms side by side, measured, beside the cost model.

Runs explicit, absorbed, LAGA and every LAGA option forward+backward on P
ranks: spawned gloo workers on CPU by default, or this process's rank under
torchrun (RANK/WORLD_SIZE set; any backend). The variants: explicit,
absorbed, laga; laga+trim (rebuild only keys a local query sees),
laga+recompute (keep the latent, rebuild K/V in backward), laga+blockwise and
laga+blockwise+trim (rebuild and attend --kv-block-size keys at a time); with
CP, laga+overlap (the latent gather overlapped with a stand-in query
projection) and laga+qproj (the same projection, gather not overlapped: the
baseline the overlap is timed against). For each variant and sequence
length: collective bytes (byte counter), activation bytes saved for backward (saved-tensor hooks,
each storage once, kv_up_weight excluded) beside the cost model's figure,
peak memory above the inputs beside the model's peak (an accelerator's
max_memory_allocated; on CPU the allocator's events under the torch profiler,
in one extra untimed run per variant), the model's attention FLOPs, median fwd+bwd time, and the worst relative error
against the float64 single-process reference. With --doc-lens/--num-docs
the forms get cu_seqlens (packed documents).
Writes JSON (every figure in the table; ``--json -``: the JSON alone on stdout,
everything else on stderr) and, with matplotlib, PNG plots.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from typing import Dict, List, Optional

from .. import costmodel as cm
from ..runspec import RunSpec, standard_runs
from ..torchrun_env import torchrun_rank, under_torchrun as _torchrun, world_size
from ...cp_algos import algo, takes_ulysses_degree
from ...kernels.registry import CPU_KERNELS, KERNEL_TYPES, KERNELS, canonical, device_of
from ...vocab.names import CP_ALGOS, DEFAULT_LAYOUT, LAYOUTS  # noqa: F401
from ...vocab.dims import ModelDims  # noqa: F401
from . import bench_dsa
from .output import MiB, check_output_path, dtype_arg, pad as _pad, ratio as _ratio
from .parsers import add_cp_algo_args, command_parser
from .bench_fit import check_block_size, check_fits
from .plot import check_plot_path, matplotlib_missing, write_plot
from .timing import speed_text, timing_conclusive  # noqa: F401  (tests ask bench for them)
from .shapes import CPU_DEFAULT, add_shape_args, positive_int, shape_from_args

DEFAULT_CP = 4
# Outputs not named on the command line go into this folder (made when needed), not the cwd.
DEFAULT_DIR = "bench_out"
DEFAULT_JSON = os.path.join(DEFAULT_DIR, "bench.json")
DEFAULT_PLOT = os.path.join(DEFAULT_DIR, "bench.png")
# How long spawned ranks may take for the whole benchmark before they count as hung: a
# bench at model dims on CPU runs for many minutes, which is not a hang.
RUN_TIMEOUT_S = 3600.0

# The table: (header, JSON key, format). Every cell is a key of the row's JSON.
COLUMNS = (
    ("variant", "variant", "{:<20}"),
    ("fwd bytes", "comm_forward_bytes", "{:>10,}"),
    ("bwd bytes", "comm_backward_bytes", "{:>10,}"),
    ("wire bytes", "comm_wire_bytes", "{:>11,}"),
    ("expl/form", "comm_explicit_over_form", "{:>9}"),
    ("saved KiB", "saved_kib", "{:>10.1f}"),
    ("model KiB", "model_saved_kib", "{:>10.1f}"),
    ("meas/model", "saved_measured_over_model", "{:>10}"),
    ("form/expl", "saved_form_over_explicit", "{:>9}"),
    ("attn GFLOP", "model_attention_gflop", "{:>10.4f}"),
    ("peak MiB", "peak_mib", "{:>8}"),
    ("model peak", "model_peak_mib", "{:>10.2f}"),
    ("ms", "ms", "{:>8.2f}"),
    ("max rel err", "max_rel_err", "{:>11.2e}"),
)


def add_parser(sub):
    p = command_parser(sub, "bench", "measure bytes, saved activations, time and error per form", __doc__)
    p.add_argument("--cp", type=positive_int, default=None,
                   help=f"CP size: gloo processes to spawn (default {DEFAULT_CP}, at most what "
                        "this machine's cores and memory hold); under torchrun the world size "
                        "(a different --cp is refused)")
    add_cp_algo_args(p, "both", algo_note=" (default both; hybrid: spawned ranks)",
                     degree_help="hybrid CP: heads split inside groups of U consecutive ranks, the "
                                 "latent (explicit: K/V) across them")
    p.add_argument("--seq-lens", "--seq-len", dest="seq_lens", default="128,256,512",
                   help="comma-separated full sequence lengths (default 128,256,512; --seq-len "
                        "is the same flag)")
    p.add_argument("--layout", choices=LAYOUTS, default=None,
                   help="sequence split (default: zigzag for allgather, contiguous for ulysses; "
                        "doc_zigzag cuts every document into 2*CP chunks, with --doc-lens/--num-docs)")
    docs = p.add_mutually_exclusive_group()
    docs.add_argument("--doc-lens", default=None, metavar="N,N,...",
                      help="packed documents' lengths (sum = the sequence length; one --seq-lens "
                           "value): the forms get cu_seqlens; batch 1")
    docs.add_argument("--num-docs", default=None, metavar="N[,N...]",
                      help="N equal documents per sequence; a list (e.g. 1,4,16) runs each")
    p.add_argument("--kernel", type=canonical, choices=KERNELS, default="sdpa",
                   help="attention kernel of the non-recomputing variants (default sdpa); "
                        "recompute variants use 'auto' (fused block ops on CPU/CUDA, npu on NPU)")
    p.add_argument("--dtype", type=dtype_arg(("float32", "bfloat16")), default="float32",
                   help="float32 (default) or bfloat16 (fp32/bf16 alike)")
    p.add_argument("--kv-block-size", type=positive_int, default=None,
                   help="keys per block of the blockwise variants (default: S/4)")
    p.add_argument("--repeat", type=positive_int, default=3, help="timed runs per variant")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument("--forms-only", action="store_true",
                   help="only explicit, absorbed and LAGA (no LAGA options)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help=f"write every figure here (default {DEFAULT_JSON}, the folder made if "
                        "needed; '-' = stdout only; '' = none)")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help=f"PNG plots (needs matplotlib: refused without it; default {DEFAULT_PLOT}, "
                        "skipped with a note at the start when matplotlib is missing; '' = none)")
    p.add_argument("--backend", default=None,
                   help="torchrun only (refused without it): process-group backend (default nccl "
                        "on CUDA, hccl on NPU, gloo)")
    add_shape_args(p, CPU_DEFAULT, seq_len=False)
    bench_dsa.add_args(p)


# ---------------------------------------------------------------- what to run

def parse_seq_lens(text: str) -> List[int]:
    return parse_ints("--seq-lens", text, distinct=True, example="128,256", items="lengths")


def parse_ints(flag: str, text: str, distinct: bool = False, example: str = "4096,1024",
               items: str = "integers") -> List[int]:
    """``flag``'s comma-separated positive ``items`` (each once with ``distinct``)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r} must be comma-separated integers, e.g. {example}")
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{flag} {text!r} must list positive {items}")
    if distinct:
        _once(flag, text, values)
    return values


def _once(flag: str, text: str, values: List[int]) -> None:
    """A list of settings to run names each once (the table groups rows by setting)."""
    twice = sorted({v for v in values if values.count(v) > 1})
    if twice:
        raise ValueError(f"{flag} {text!r} lists {', '.join(map(str, twice))} more than once; "
                         "give each value once")


def document_settings(args, seq_len: int) -> List[Optional[tuple]]:
    """The document lengths to run at ``seq_len``: [None] without --doc-lens/--num-docs."""
    if args.doc_lens is not None:
        return [cm.doc_lens_for(seq_len, parse_ints("--doc-lens", args.doc_lens))]
    if args.num_docs is not None:
        return [cm.doc_lens_for(seq_len, num_docs=n)
                for n in parse_ints("--num-docs", args.num_docs, distinct=True)]
    return [None]


def variants_for(args, seq_len: int, cp_size: int) -> List[RunSpec]:
    """The three forms plus every LAGA option (overlap only with CP, beside a twin
    without it that runs the same stand-in query projection)."""
    return standard_runs(args.kv_block_size or max(seq_len // 4, 1), overlap=cp_size > 1,
                         query_projection_pair=True, forms_only=args.forms_only)


def model_config(args, shape, cp_size: int, algo: str, kernel: str, device_type: str,
                 ulysses_degree: int = 1) -> cm.Config:
    """The cost model's config of one bench run (measure.case_config's rules)."""
    from ..measure import model_kernel, shape_dims
    return cm.Config(shape_dims(shape), shape.seq_len, shape.batch, cp_size, 1, algo,
                     DEFAULT_LAYOUT[algo], args.dtype, model_kernel(kernel, device_type), True,
                     ulysses_degree=ulysses_degree)


def ulysses_degree_from_args(args, cp_size: int) -> int:
    """U for --cp-algo hybrid (1 otherwise), checked before anything runs."""
    degree = getattr(args, "ulysses_degree", None)
    if not takes_ulysses_degree(args.cp_algo):
        if degree is not None:
            raise ValueError(f"--ulysses-degree goes with --cp-algo hybrid, not --cp-algo {args.cp_algo}")
        return 1
    if degree is None:
        raise ValueError("--cp-algo hybrid needs --ulysses-degree U (a divisor of --cp)")
    if _torchrun():
        raise ValueError("--cp-algo hybrid runs on spawned gloo ranks; run it without torchrun")
    if not algo(args.cp_algo).degree_divides(cp_size, degree):
        raise ValueError(f"--ulysses-degree {degree} must divide --cp {cp_size}")
    return degree


def build_runs(args, cp_size: int, device_type: str):
    """Every (sequence length, documents, cp_algo, variant) run and its model (rank 0)."""
    from ..cases import Case
    from ..measure import case_config
    algos = CP_ALGOS if args.cp_algo == "both" else (args.cp_algo,)
    if (args.doc_lens or args.num_docs) and args.micro_batch != 1:
        raise ValueError(f"--doc-lens/--num-docs pack documents into one sequence: use "
                         f"--micro-batch 1 (got {args.micro_batch})")
    degree = ulysses_degree_from_args(args, cp_size)
    runs, models = [], []
    seq_lens = parse_seq_lens(args.seq_lens)
    check_block_size(args.kv_block_size, seq_lens)
    for seq_len in seq_lens:
        shape = shape_from_args(args, seq_len)
        for doc_lens, name in [(d, a) for d in document_settings(args, seq_len) for a in algos]:
            layout = args.layout or DEFAULT_LAYOUT[name]
            cfg = replace(model_config(args, shape, cp_size, name, args.kernel, device_type, degree),
                          layout=layout, doc_lens=doc_lens)
            variants = variants_for(args, seq_len, cp_size)
            cm.validate(cfg, variants)
            bounds = cfg.documents
            for v in variants:
                kernel = "auto" if v.recompute_kv else args.kernel
                case = Case(spec=v, cp_algo=name, layout=layout, kernel=kernel, dtype=args.dtype,
                            shape=shape, cu_seqlens=bounds,
                            ulysses_degree=degree if algo(name).takes_ulysses_degree else 1)
                runs.append(case)
                models.append(_model(case_config(case, cp_size, device_type), v, cp_size))
    return runs, models


def _model(cfg, spec: RunSpec, cp_size: int):
    """Rank 0's costs (what the table compares with rank 0's measurement), with the peak
    terms of the rank the model expects to peak highest (the table's peak is the worst
    rank's)."""
    costs = [cm.form_cost(cfg, spec, r) for r in range(cp_size)]
    return replace(costs[0], peak=max(costs, key=lambda c: c.peak_bytes).peak)


# ---------------------------------------------------------------- rows

def make_rows(runs, models, per_rank: List[List[dict]], ulysses_degree: int = 1) -> List[dict]:
    """One JSON row per run: measured (rank 0, worst error/time over ranks) and modelled."""
    from .. import equivalence as eq
    rows = []
    refs: Dict[tuple, dict] = {}
    for i, (case, model) in enumerate(zip(runs, models)):
        ranks = [r[i] for r in per_rank]
        key = (case.shape, case.dtype, case.seed, case.causal, case.cu_seqlens)
        if key not in refs:
            refs[key] = eq.reference(case) if case.cu_seqlens is None else document_reference(case)
        err = max(eq.relative_errors(eq.assemble(ranks, case), refs[key]).values())
        r0 = ranks[0]
        fwd = _comm(r0, "forward", "payload")
        bwd = _comm(r0, "backward", "payload")
        wire = _comm(r0, "forward", "wire") + _comm(r0, "backward", "wire")
        peak = [r["peak_bytes"] for r in ranks if r["peak_bytes"] is not None]
        unmeasured = [r.get("peak_reason") for r in ranks if r["peak_bytes"] is None]
        rows.append({
            "seq_len": case.shape.seq_len, "cp_algo": case.cp_algo, "layout": case.layout,
            "documents": len(case.cu_seqlens) - 1 if case.cu_seqlens else 1,
            "cu_seqlens": list(case.cu_seqlens) if case.cu_seqlens else None,
            "variant": case.spec.name, "form": case.form, "kernel": case.kernel,
            "model_kernel": model.kernel, "options": dict(case.options),
            "comm_forward_bytes": fwd, "comm_backward_bytes": bwd, "comm_wire_bytes": wire,
            "comm_design_bytes": sum(r0["design_bytes"].values()),
            "model_comm_forward_bytes": model.comm_bytes("forward"),
            "model_comm_backward_bytes": model.comm_bytes("backward"),
            "model_comm_wire_bytes": model.comm_bytes(None, "wire"),
            "saved_bytes": r0["saved_bytes"], "saved_kib": r0["saved_bytes"] / 1024,
            "saved_bytes_by_rank": [r["saved_bytes"] for r in ranks],
            "model_saved_bytes": model.saved_bytes, "model_saved_kib": model.saved_bytes / 1024,
            "model_saved_terms": [t.__dict__ for t in model.saved],
            "saved_measured_over_model": _ratio(r0["saved_bytes"], model.saved_bytes),
            "peak_bytes": max(peak) if peak else None,
            "peak_mib": f"{max(peak) / MiB:.2f}" if peak else "n/a",
            "peak_reason": None if peak else (unmeasured[0] if unmeasured else None),
            "model_peak_bytes": model.peak_bytes, "model_peak_mib": model.peak_bytes / MiB,
            "model_peak_terms": [t.__dict__ for t in model.peak],
            "peak_measured_over_model": _ratio(max(peak), model.peak_bytes) if peak else None,
            "model_attention_flops": model.flops["attention_fwd"] + model.flops["attention_bwd"],
            "model_attention_gflop": (model.flops["attention_fwd"] + model.flops["attention_bwd"]) / 1e9,
            "model_attention_visible_fwd_flops": model.flops["attention_visible_fwd"],
            "ms": 1e3 * max(r["seconds"] for r in ranks),
            **_time_spread(ranks),
            "comm_seconds": r0.get("comm_seconds"),
            "max_rel_err": err,
        })
        if ulysses_degree > 1:
            rows[-1].update({"ulysses_degree": ulysses_degree,
                             "comm_wire_by_group": r0["wire_by_group"],
                             "model_comm_wire_by_group": cm.comm_by_group(model)})
    _add_relative(rows)
    return rows


def _time_spread(ranks: List[dict]) -> dict:
    """The fastest and slowest timed run, each run timed by its slowest rank."""
    runs = [max(per_rank) for per_rank in zip(*(r.get("seconds_runs") or [r["seconds"]] for r in ranks))]
    return {"ms_min": 1e3 * min(runs), "ms_max": 1e3 * max(runs), "timed_runs": len(runs)}


def _comm(result, direction, measure) -> int:
    return sum(v[measure] for k, v in result["comm"].get(direction, {}).items() if k != "handshake")


def _group(r: dict) -> tuple:
    return r["seq_len"], r["cp_algo"], r["documents"]


def document_reference(case) -> dict:
    """Float64 single-device output and grads with packed documents: every document is
    an independent sequence, so the reference runs each alone and concatenates (the
    kv_up_weight grads add up)."""
    import torch
    from ..cases import DTYPES, INPUTS, full_inputs
    from ...reference import mla_attention_reference
    full = full_inputs(case.shape, case.seed)
    dtype = DTYPES[case.dtype]
    inputs = {k: full[k].to(dtype).double().requires_grad_() for k in INPUTS}
    grad_out = full["grad_out"].to(dtype).double()
    outs = []
    for a, b in zip(case.cu_seqlens[:-1], case.cu_seqlens[1:]):
        outs.append(mla_attention_reference(*(inputs[k][a:b] for k in INPUTS[:3]), inputs["kv_up_weight"],
                                            softmax_scale=case.shape.softmax_scale, causal=case.causal))
    out = torch.cat(outs)
    out.backward(grad_out)
    return {"out": out.detach(), "grads": {k: v.grad for k, v in inputs.items()}}


def _add_relative(rows: List[dict]) -> None:
    """Ratios against explicit at the same (seq_len, cp_algo); the overlap share."""
    groups: Dict[tuple, Dict[str, dict]] = {}
    for r in rows:
        groups.setdefault(_group(r), {})[r["variant"]] = r
    for group in groups.values():
        ex = group["explicit"]
        for r in group.values():
            total = r["comm_forward_bytes"] + r["comm_backward_bytes"]
            r["comm_explicit_over_form"] = _ratio(ex["comm_forward_bytes"] + ex["comm_backward_bytes"], total)
            r["saved_form_over_explicit"] = _ratio(r["saved_bytes"], ex["saved_bytes"])
        base, ov = group.get("laga+qproj"), group.get("laga+overlap")
        if base and ov:
            ov["overlap_speedup"] = base["ms"] / ov["ms"]
            ov["overlap_conclusive"] = timing_conclusive(base, ov)
            blocked = [(x.get("comm_seconds") or {}).get("latent") for x in (base, ov)]
            if None not in blocked and blocked[0] > 0:
                ov["latent_blocked_ms"] = {"without_overlap": 1e3 * blocked[0], "with_overlap": 1e3 * blocked[1]}
                ov["latent_comm_hidden_share"] = 1 - blocked[1] / blocked[0]


# ---------------------------------------------------------------- output

def print_table(rows: List[dict], out=None) -> None:
    out = out or sys.stdout
    header = " ".join(_pad(h, fmt) for h, _, fmt in COLUMNS)
    current = None
    for r in rows:
        if _group(r) != current:
            current = _group(r)
            docs = f" documents={r['documents']}" if r["cu_seqlens"] else ""
            hybrid = f" U={r['ulysses_degree']}" if "ulysses_degree" in r else ""
            print(f"\nS={r['seq_len']} cp_algo={r['cp_algo']}{hybrid} layout={r['layout']}{docs}",
                  file=out)
            print(header, file=out)
            print("-" * len(header), file=out)
        print(" ".join(fmt.format(r[key]) for _, key, fmt in COLUMNS), file=out)
        if "comm_wire_by_group" in r:
            got, model = r["comm_wire_by_group"], r["model_comm_wire_by_group"]
            print("  wire by group (measured / model): " + ", ".join(
                f"{g} {got.get(g, 0):,} / {model.get(g, 0):,.0f}" for g in GROUPS), file=out)
        if "latent_comm_hidden_share" in r:
            base = next(x for x in rows if _group(x) == _group(r) and x["variant"] == "laga+qproj")
            print(overlap_text(base, r), file=out)
    if any("comm_wire_by_group" in r for r in rows):
        degree = next(r["ulysses_degree"] for r in rows if "ulysses_degree" in r)
        print(f"\ngroups: ulysses = the {degree} ranks that split heads (one node); ring = the ranks "
              "with the same Ulysses rank (explicit gathers K/V here, across nodes); cp = every "
              "rank (the latent forms gather the latent here)", file=out)


def overlap_text(base: dict, ov: dict) -> str:
    """The overlap line: a speedup where the timing is conclusive, else why it is not."""
    if not ov.get("overlap_conclusive"):
        spread = " and ".join(f"{r['variant']} {r['ms']:.2f} ms (runs {r.get('ms_min', r['ms']):.2f}-"
                              f"{r.get('ms_max', r['ms']):.2f})" for r in (base, ov))
        return (f"  overlap: timing inconclusive on this machine: {spread}; the runs spread more "
                "than the difference (or fewer than 2 timed runs); rerun with more --repeat, longer "
                "--seq-lens or on an idle machine")
    b = ov["latent_blocked_ms"]
    return (f"  overlap: fwd+bwd {speed_text(ov['overlap_speedup'])} against laga+qproj (same "
            "work, gather not overlapped); latent gather + "
            f"reduce-scatter blocked {b['without_overlap']:.2f} ms -> {b['with_overlap']:.2f} ms "
            f"({hidden_share_text(ov['latent_comm_hidden_share'])})")


# Hybrid CP's groups, in the order the tables list them (every row names all three).
GROUPS = ("ulysses", "ring", "cp")


def hidden_share_text(share: float) -> str:
    """The overlap's hidden share; below zero the overlapped run blocked longer, which is
    timing noise (the overlap adds no communication), not a negative amount hidden."""
    if share >= 0:
        return f"{100 * share:.0f}% hidden"
    return (f"none hidden: {100 * share:.0f}% is timing noise, the overlapped run blocked "
            "longer; rerun with more --repeat or longer --seq-lens")


# ---------------------------------------------------------------- hybrid CP (spawned ranks)


def hybrid_worker(rank: int, cp_size: int, degree: int, runs, repeat: int, warmup: int,
                  cpu_peak: bool = False) -> List[dict]:
    """:func:`run_on_ranks` entry for --cp-algo hybrid: one result per run, in the format
    of ``measure.run_on_rank`` plus the wire bytes per group."""
    import torch.distributed as dist
    from ...comm import ulysses_group
    from ..measure import run_on_rank
    from ..measure import interleaved
    group = ulysses_group(dist.group.WORLD, degree)

    def run_one(case, flops, peak):
        return run_on_rank(case, rank, cp_size, dist.group.WORLD, 1, 0, flops, ulysses_group=group,
                           cpu_peak=peak)

    def say(i, case):
        if rank == 0:
            print(f"  [{i + 1}/{len(runs)}] {case.spec.name} S={case.shape.seq_len} hybrid U={degree}",
                  file=sys.stderr, flush=True)
    return interleaved(runs, run_one, repeat, warmup, cpu_peak=cpu_peak, progress=say)


# ---------------------------------------------------------------- running

def _run_torchrun(args, runs, repeat, warmup):
    """This process is one rank: run every variant, gather all ranks' results on every rank."""
    import torch.distributed as dist
    from ..measure import default_backend, set_local_device, worker
    backend = args.backend or default_backend()
    set_local_device(backend, int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    try:
        mine = worker(dist.get_rank(), dist.get_world_size(), runs, repeat, warmup, False, True,
                      cpu_peak=True, interleave=True)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return gathered, dist.get_rank()
    finally:
        dist.destroy_process_group()


def run(args) -> int:
    from ..spawn import run_on_ranks
    from ..measure import device_type as measure_device_type, worker
    cp_size = world_size(args.cp, args.backend, DEFAULT_CP)
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if bench_dsa.wanted(args):
        args.cp = cp_size
        return _run_dsa(args)
    out = sys.stderr if args.json == "-" else sys.stdout  # --json -: stdout is the JSON's
    plot_note = resolve_plot(args)
    if args.json is None:
        args.json = DEFAULT_JSON
    check_plot_path(args.plot)
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path in (DEFAULT_JSON, DEFAULT_PLOT) and not os.path.isdir(DEFAULT_DIR):
            check_output_path(flag, DEFAULT_DIR)  # made when the run writes: its place is writable
        else:
            check_output_path(flag, path)
    torchrun = _torchrun()
    device_type = measure_device_type(args.backend) if torchrun else "cpu"
    check_kernel(args.kernel, device_type, torchrun)
    runs, models = build_runs(args, cp_size, device_type)
    check_fits(runs, models, int(os.environ.get("LOCAL_WORLD_SIZE", cp_size)) if torchrun else cp_size)
    where = f"torchrun, world size {cp_size}" if torchrun else f"{cp_size} spawned gloo CPU ranks"
    s = runs[0].shape
    if torchrun_rank() == 0:  # every torchrun rank runs this; one says what runs
        print(f"bench: {where}; {len(runs)} runs ({args.warmup} warm-up + {args.repeat} timed each); "
              f"b={s.batch}, n={s.heads}, d_n={s.qk_head_dim}, d_r={s.rope_dim}, d_v={s.v_head_dim}, "
              f"d_c={s.kv_lora_rank}, {args.dtype}, kernel={args.kernel}", file=out, flush=True)
        if plot_note:
            print(plot_note, file=out, flush=True)
    start = time.perf_counter()
    if torchrun:
        per_rank, rank = _run_torchrun(args, runs, args.repeat, args.warmup)
        if rank != 0:
            return 0
    elif takes_ulysses_degree(args.cp_algo):
        per_rank = run_on_ranks(hybrid_worker, cp_size, args.ulysses_degree, runs, args.repeat,
                                args.warmup, True, timeout_s=RUN_TIMEOUT_S)
    else:
        # (count_flops, progress, cpu_peak): spawned ranks run on the CPU, measure its peak
        # (count_flops, progress, cpu_peak, interleave): the variants' runs in rounds
        per_rank = run_on_ranks(worker, cp_size, runs, args.repeat, args.warmup, False, True, True, True,
                                timeout_s=RUN_TIMEOUT_S)
    rows = make_rows(runs, models, per_rank,
                     args.ulysses_degree if takes_ulysses_degree(args.cp_algo) else 1)
    print_table(rows, out)
    print_document_trend(rows, out)
    print(f"\nbytes: rank 0's payload handed to the collectives (fwd, bwd) and bytes it sends "
          f"(wire); saved: activations autograd keeps in the attention call, each storage once, "
          f"kv_up_weight excluded (rank 0), beside the cost model; ms: slowest rank's median "
          f"fwd+bwd; err: worst output/grad error vs the float64 reference; attn GFLOP: the "
          f"model's attention FLOPs (fwd+bwd, rank 0, as the kernels execute them).", file=out)
    reasons = [r["peak_reason"] for r in rows if r["peak_reason"]]
    print(peak_note(device_type, reasons[0] if reasons else None), file=out)
    print(f"wall time: {time.perf_counter() - start:.1f} s", file=out)
    _write_outputs(args, rows, cp_size, where, out)
    return 0


def _run_dsa(args) -> int:
    """bench --dsa: the sparse-MLA gather's table and JSON (no plot: its figures are bytes)."""
    if args.plot:
        raise ValueError(f"--plot {args.plot!r} draws the dense forms' panels; bench --dsa prints "
                         "its table and writes JSON only: drop --plot")
    if args.json is None:  # the default file in the default folder, made when missing
        args.json = DEFAULT_JSON
        check_output_path("--json", DEFAULT_DIR if not os.path.isdir(DEFAULT_DIR) else DEFAULT_JSON)
        os.makedirs(DEFAULT_DIR, exist_ok=True)
    return bench_dsa.run(args, parse_seq_lens(args.seq_lens), shape_from_args(args, 1))


def resolve_plot(args) -> Optional[str]:
    """--plot's path: the default, or refused when asked for without matplotlib; returns the
    note to print at the start when the default plot is skipped for want of it."""
    if args.plot is None:
        args.plot = DEFAULT_PLOT
        if matplotlib_missing():
            args.plot = ""
            return "plot: none (matplotlib is not installed; pip install matplotlib for the PNG)"
    elif args.plot and matplotlib_missing():
        raise ValueError(f"--plot {args.plot!r} needs matplotlib, which is not installed: "
                         "pip install matplotlib, or drop --plot")
    return None


def check_kernel(kernel: str, device_type: str, torchrun: bool) -> None:
    """A kernel that runs on one device type only (npu: NPU tensors) needs torchrun on such
    a host with what it runs on installed (checked here, before any rank starts)."""
    needs = device_of(kernel)
    if needs is None:
        return
    on_cpu = "/".join(reversed(CPU_KERNELS))
    if not torchrun:
        raise ValueError(f"--kernel {kernel} runs on {needs.upper()} tensors, but without torchrun "
                         f"bench spawns gloo CPU ranks; run it under torchrun on "
                         f"{KERNEL_TYPES[kernel].device_host}, or use --kernel {on_cpu} on CPU")
    KERNEL_TYPES[kernel].check_installed()
    if device_type != needs:
        raise ValueError(f"--kernel {kernel} runs on {needs.upper()} tensors, but this torchrun job "
                         f"runs on {device_type}; use --kernel {on_cpu}/auto here")


def peak_note(device_type: str, unmeasured: Optional[str] = None) -> str:
    """What the two peak columns are, and whether this machine checks the model's
    (``unmeasured``: why the measured peak is n/a, if it is)."""
    what = ("model peak: the cost model's prediction in MiB for the rank it expects highest "
            "(saved + output + the largest transient, costmodel/peak.py)")
    if unmeasured:
        return f"peak: n/a ({unmeasured}); {what}, unchecked on this machine."
    if device_type == "cpu":
        return ("peak: the CPU allocator's peak above the inputs, from the torch profiler's "
                "memory events in one extra untimed fwd+bwd per variant (worst rank); "
                f"{what}.")
    return (f"peak: max_memory_allocated above the inputs after reset_peak_memory_stats "
            f"({device_type}, worst rank); {what}.")


def print_document_trend(rows: List[dict], out=None) -> None:
    """The blockwise path's attention FLOPs and time against the number of documents."""
    out = out or sys.stdout
    trends: Dict[tuple, List[dict]] = {}
    for r in rows:
        if r["variant"] == "laga+blockwise":
            trends.setdefault((r["seq_len"], r["cp_algo"]), []).append(r)
    for (seq_len, algo), rs in trends.items():
        if len(rs) < 2:
            continue
        first = rs[0]
        cells = ", ".join(f"{r['documents']} docs {r['model_attention_gflop']:.4f} GFLOP "
                          f"({r['model_attention_flops'] / first['model_attention_flops']:.3f}x) "
                          f"{r['ms']:.2f} ms ({_time_ratio(first, r)})" for r in rs)
        print(f"\nlaga+blockwise S={seq_len} {algo}, attention vs documents: {cells}", file=out)


def _time_ratio(first: dict, r: dict) -> str:
    """r's time against the first row's, where the runs' spread does not swamp it."""
    if r is first or timing_conclusive(first, r):
        return f"{r['ms'] / first['ms']:.2f}x"
    return "ratio inconclusive: the runs spread more than the difference"


def figure_title(args, rows: List[dict], cp_size: int, where: str) -> str:
    """The configuration a plot was measured at, for its title."""
    degree = next((r["ulysses_degree"] for r in rows if "ulysses_degree" in r), None)
    hybrid = f", hybrid U={degree}" if degree else ""
    docs = f", documents {args.doc_lens or args.num_docs}" if args.doc_lens or args.num_docs else ""
    return (f"mindspeed-laga bench: CP={cp_size}{hybrid} ({where}), micro-batch {args.micro_batch}, "
            f"heads {args.heads}, d_n={args.qk_head_dim}, d_r={args.qk_pos_emb_head_dim}, "
            f"d_v={args.v_head_dim}, d_c={args.kv_lora_rank}{docs}\n{args.dtype}, kernel={args.kernel} "
            f"(recompute variants: auto), {args.warmup} warm-up + {args.repeat} timed runs each")


def _write_outputs(args, rows, cp_size, where, out) -> None:
    if {args.json, args.plot} & {DEFAULT_JSON, DEFAULT_PLOT}:
        os.makedirs(DEFAULT_DIR, exist_ok=True)
    doc = {"cp_size": cp_size, "where": where, "dtype": args.dtype, "kernel": args.kernel,
           "doc_lens": args.doc_lens, "num_docs": args.num_docs, "layout": args.layout,
           "repeat": args.repeat, "warmup": args.warmup, "columns": [k for _, k, _ in COLUMNS],
           "rows": rows}
    if args.json and args.json != "-":
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"JSON: {args.json}", file=out)
    if args.plot:
        written = write_plot(rows, args.plot, figure_title(args, rows, cp_size, where))
        print(f"plot: {written}", file=out)
    if args.json == "-":
        print(json.dumps(doc, indent=1, default=str), flush=True)

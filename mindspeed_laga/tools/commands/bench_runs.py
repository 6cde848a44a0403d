"""What ``bench`` runs: the lengths and documents asked, every variant at each as a case,
the cost model's figures for each, and hybrid CP's worker."""
from __future__ import annotations

import sys
from dataclasses import replace
from typing import List, NamedTuple, Optional

from .. import costmodel as cm
from ..runspec import RunSpec, standard_runs
from ..torchrun_env import under_torchrun as _torchrun
from ..mla_shape import MLAShape
from ...cp_algos import algo, takes_ulysses_degree
from ...kernels.registry import model_kind
from ...vocab.dims import ModelDims
from ...vocab.names import CP_ALGOS, DEFAULT_LAYOUT
from .bench_fit import check_block_size
from .shapes import shape_from_args


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
    """The cost model's config of one bench run (measure.case_config's rules), torch-free."""
    return cm.Config(ModelDims(shape.heads, shape.qk_head_dim, shape.rope_dim, shape.v_head_dim,
                               shape.kv_lora_rank), shape.seq_len, shape.batch, cp_size, 1, algo,
                     DEFAULT_LAYOUT[algo], args.dtype, model_kind(kernel, device_type), True,
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


class PlannedRun(NamedTuple):
    """One run as ``cases.Case`` takes it, planned without torch (Case imports it)."""
    spec: RunSpec
    cp_algo: str
    layout: str
    kernel: str
    dtype: str
    shape: MLAShape
    cu_seqlens: Optional[tuple]
    ulysses_degree: int


def plan_runs(args, cp_size: int, device_type: str):
    """Every (sequence length, documents, cp_algo, variant) run and its model (rank 0),
    each checked, before torch is imported."""
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
            for v in variants:
                kernel = "auto" if v.recompute_kv else args.kernel
                runs.append(PlannedRun(v, name, layout, kernel, args.dtype, shape, cfg.documents,
                                       degree if algo(name).takes_ulysses_degree else 1))
                models.append(_model(replace(cfg, kernel=model_kind(kernel, device_type),
                                             ulysses_degree=runs[-1].ulysses_degree), v, cp_size))
    return runs, models


def as_cases(runs):
    """The planned runs as ``cases.Case`` (imports torch)."""
    from ..cases import Case
    return [Case(**r._asdict()) for r in runs]


def build_runs(args, cp_size: int, device_type: str):
    """:func:`plan_runs` with the runs as ``cases.Case``."""
    runs, models = plan_runs(args, cp_size, device_type)
    return as_cases(runs), models


def _model(cfg, spec: RunSpec, cp_size: int):
    """Rank 0's costs (what the table compares with rank 0's measurement), with the peak
    terms of the rank the model expects to peak highest (the table's peak is the worst
    rank's)."""
    costs = [cm.form_cost(cfg, spec, r) for r in range(cp_size)]
    return replace(costs[0], peak=max(costs, key=lambda c: c.peak_bytes).peak)


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

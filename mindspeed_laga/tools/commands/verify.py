"""``mindspeed-laga verify``: the three forms on P gloo ranks against the reference.

Spawns P CPU processes, runs explicit, absorbed and LAGA forward+backward on
the same inputs, and prints per form: the worst relative error (output and
every grad) against the float64 single-device reference on the full
sequence, collective bytes forward/backward (from the byte counter), and the
median fwd+bwd wall time. Exits 1 if any error is above the tolerance. It spawns its
own ranks, so under torchrun it is refused (every torchrun rank would spawn a full check).
"""
from __future__ import annotations

from dataclasses import replace
from typing import List

from ..rank_cap import check_spawnable
from ..torchrun_env import under_torchrun
from ..runspec import standard_runs
from ...cp_algos import algo
from ...kernels.registry import CPU_KERNELS, canonical
from ...vocab.names import CP_ALGOS, DEFAULT_LAYOUT, SEQUENCE_LAYOUTS
from .bench_fit import check_fits
from .bench_runs import (PlannedRun, _model, as_cases, hybrid_worker, model_config,
                         ulysses_degree_from_args)
from ...vocab.segments import check_seq_len
from .output import dtype_arg
from .parsers import add_cp_algo_args, command_parser
from .shapes import add_shape_args, check_seq_len_bound, positive_int, shape_from_args

TOLERANCE = {"float32": 1e-5, "bfloat16": 8 * 2.0 ** -9}


def add_parser(sub):
    p = command_parser(sub, "verify", "run the three forms on P gloo ranks and check them", __doc__)
    p.add_argument("--cp", type=positive_int, default=4, help="CP size (gloo processes), default 4")
    add_cp_algo_args(p, "both", algo_note=" (default both)",
                     degree_help="hybrid CP: heads split inside groups of U consecutive ranks, the "
                                 "latent (explicit: K/V) across them")
    p.add_argument("--layout", choices=SEQUENCE_LAYOUTS, default=None,
                   help="default: " + ", ".join(f"{DEFAULT_LAYOUT[a]} for {a}" for a in CP_ALGOS))
    p.add_argument("--kernel", type=canonical, choices=CPU_KERNELS, default="sdpa")
    p.add_argument("--dtype", type=dtype_arg(tuple(TOLERANCE)), default="float32",
                   help="float32 (default) or bfloat16 (fp32/bf16 alike)")
    p.add_argument("--repeat", type=positive_int, default=3, help="timed runs after one warm-up")
    add_shape_args(p)


def planned_from_args(args) -> List[PlannedRun]:
    """The runs verify makes (the three forms under each algorithm), planned without torch."""
    shape = shape_from_args(args)
    algos = CP_ALGOS if args.cp_algo == "both" else (args.cp_algo,)
    degree = ulysses_degree_from_args(args, args.cp)
    return [PlannedRun(v, a, args.layout or DEFAULT_LAYOUT[a], args.kernel, args.dtype, shape, None,
                       degree if algo(a).takes_ulysses_degree else 1)
            for a in algos for v in standard_runs(forms_only=True)]


def cases_from_args(args):
    return as_cases(planned_from_args(args))


def check_runs(args, runs: List[PlannedRun]) -> None:
    """Every refusal verify can make without torch: the length, the split, the heads, and
    bench's fit check (the ranks' float64 inputs and peaks, the reference's S x S scores)."""
    check_seq_len_bound("--seq-len", args.seq_len)
    degree = runs[0].ulysses_degree
    for layout in dict.fromkeys(r.layout for r in runs):
        check_seq_len(args.seq_len, layout, args.cp, ulysses_degree=degree)
    if not all(algo(r.cp_algo).heads_divide(args.heads, args.cp, r.ulysses_degree) for r in runs):
        split = f"--ulysses-degree {degree}" if degree > 1 else f"--cp {args.cp}"
        raise ValueError(f"--heads {args.heads} is not divisible by {split} (ulysses splits heads)")
    models = [_model(replace(model_config(args, r.shape, args.cp, r.cp_algo, r.kernel, "cpu",
                                          r.ulysses_degree), layout=r.layout), r.spec, args.cp)
              for r in runs]
    check_fits(runs, models, args.cp, flag="--seq-len")


def run(args) -> int:
    if under_torchrun():
        raise ValueError("verify spawns its own --cp gloo ranks: run `mindspeed-laga verify` "
                         "without torchrun (under torchrun every rank would run the whole check)")
    check_spawnable(args.cp)
    planned = planned_from_args(args)
    check_runs(args, planned)
    # every check passed without torch: now the ranks
    from .. import equivalence as eq
    from ..measure import worker
    from ..spawn import run_on_ranks
    cases = as_cases(planned)
    degree = cases[0].ulysses_degree
    s = cases[0].shape
    hybrid = f" (hybrid U={degree})" if degree > 1 else ""
    print(f"verify: CP={args.cp} gloo ranks{hybrid}, S={s.seq_len}, b={s.batch}, n={s.heads}, "
          f"d_n={s.qk_head_dim}, d_r={s.rope_dim}, d_v={s.v_head_dim}, d_c={s.kv_lora_rank}, "
          f"{args.dtype}, kernel={args.kernel}")
    if degree > 1:
        per_rank = run_on_ranks(hybrid_worker, args.cp, degree, cases, args.repeat, 1)
    else:
        per_rank = run_on_ranks(worker, args.cp, cases, args.repeat, 1)
    failed = False
    header = f"{'form':<9} {'cp_algo':<9} {'layout':<10} {'max rel err':>11} {'fwd bytes':>10} " \
             f"{'bwd bytes':>10} {'explicit/form':>13} {'fwd+bwd ms':>10}"
    print(header)
    print("-" * len(header))
    explicit_bytes = {}
    for i, case in enumerate(cases):
        ranks = [r[i] for r in per_rank]
        err = max(eq.relative_errors(eq.assemble(ranks, case), eq.reference(case)).values())
        fwd = _bytes(ranks[0], "forward")
        bwd = _bytes(ranks[0], "backward")
        explicit_bytes.setdefault(case.cp_algo, fwd + bwd if case.form == "explicit" else None)
        base = explicit_bytes[case.cp_algo]
        ratio = f"{base / (fwd + bwd):.2f}x" if base else "-"
        ms = 1e3 * max(r["seconds"] for r in ranks)
        ok = err <= TOLERANCE[args.dtype]
        failed |= not ok
        print(f"{case.form:<9} {case.cp_algo:<9} {case.layout:<10} {err:>11.2e} {fwd:>10,} "
              f"{bwd:>10,} {ratio:>13} {ms:>10.1f}{'' if ok else '  FAIL'}")
    print("bytes: per rank, payload handed to the collectives (all-gather input, reduce-scatter "
          "output, all-to-all input); time: slowest rank's median")
    print("FAILED: errors above tolerance" if failed else
          f"OK: every form matches the reference within {TOLERANCE[args.dtype]:g}")
    return 1 if failed else 0


def _bytes(result, direction) -> int:
    kinds = result["comm"].get(direction, {})
    return sum(v["payload"] for k, v in kinds.items() if k != "handshake")

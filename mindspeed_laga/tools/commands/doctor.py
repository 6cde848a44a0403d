"""``mindspeed-laga doctor``: qualify a node in one command.

Reports the environment (Python, torch, torch_npu / CUDA / CANN, devices,
MindSpeed, MindSpeed-LLM and megatron-core versions, which LAGA paths run
here); checks every form x kernel x LAGA option on this device against a
float64 CPU reference (output and every grad, small DeepSeek-shaped dims and
DeepSeek-V3's exact head dims, packed documents, both V layouts on NPU, the
blockwise log-sum-exp merge); runs the three forms and LAGA's options under
context parallelism against the reference with the bytes each moves; and
times them at ``--seq-len`` with peak memory. Under torchrun the CP runs use
the real backend (HCCL, NCCL, gloo); otherwise ``--cp`` gloo ranks are
spawned on CPU. Exits 1 on any mismatch.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING, List, Optional

from ..mla_shape import MLAShape
from ..runspec import standard_runs
from ..torchrun_env import under_torchrun as _torchrun, world_size
from ...kernels.registry import KERNEL_TYPES
from ...vocab.names import CP_ALGOS, DEFAULT_LAYOUT, LAYOUTS
from ...vocab.segments import check_seq_len
from . import doctor_report
from .output import check_output_path, claim_stdout
from .parsers import command_parser
from .shapes import CPU_DEFAULT, positive_int
from .verify import TOLERANCE

if TYPE_CHECKING:
    from ..cases import Case
# the heavier modules (cases, environment, exactness) are imported where used, not to parse
# the arguments (the kernel choices' registry imports torch itself).

# The bench shape on an accelerator: DeepSeek-V3's MLA (128 heads = one TP rank at TP 1).
DEEPSEEK_V3 = MLAShape(seq_len=4096, batch=1, heads=128, qk_head_dim=128, rope_dim=64,
                       v_head_dim=128, kv_lora_rank=512)
CHECK_SEQ_LEN = 256  # the CP check's sequence (rounded up to a multiple of 2*CP)
CHECK_HEADS = 16
DEFAULT_CP = 2


def add_parser(sub):
    p = command_parser(sub, "doctor", "qualify this node: environment, exactness, CP, bench", __doc__)
    p.add_argument("--cp", type=positive_int, default=None,
                   help=f"CP size: gloo CPU ranks to spawn (default {DEFAULT_CP}); under torchrun "
                        "the world size (a different --cp is refused)")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="bench sequence length (default 4096 on an accelerator, 256 on CPU, "
                        "rounded up to a multiple of 2*CP)")
    p.add_argument("--heads", type=positive_int, default=None,
                   help="bench heads (default 128 = DeepSeek-V3 at TP 1 on an accelerator, 16 on CPU)")
    p.add_argument("--check-seq-len", type=positive_int, default=None,
                   help=f"sequence length of the CP equivalence check (default {CHECK_SEQ_LEN}, "
                        "rounded up to a multiple of 2*CP)")
    p.add_argument("--repeat", type=positive_int, default=3, help="timed bench runs per variant")
    p.add_argument("--warmup", type=int, default=1, help="untimed bench runs first (default 1)")
    p.add_argument("--no-bench", action="store_true", help="skip the bench")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the whole report as JSON ('-': the JSON alone on stdout, the "
                        "report on stderr)")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help="write the report as Markdown (attach it to an issue on the project's "
                        "issue tracker; '-': the Markdown alone on stdout, the report on stderr)")
    p.add_argument("--backend", default=None,
                   help="torchrun only (refused without it): process-group backend (default hccl "
                        "on NPU, nccl on CUDA, gloo)")


# ---------------------------------------------------------------- arguments

def check_distinct_outputs(json_path, markdown_path) -> None:
    """One report per path: --json and --markdown naming one file would leave only the
    second report there."""
    paths = [p for p in (json_path, markdown_path) if p and p != "-"]
    if len(paths) == 2 and os.path.realpath(paths[0]) == os.path.realpath(paths[1]):
        raise ValueError(f"--json {json_path!r} and --markdown {markdown_path!r} name one file: the "
                         "second report would replace the first; give each its own path")


def resolve(args):
    """Check every argument and output path before anything runs; fill defaults."""
    args.cp_size = world_size(args.cp, args.backend, DEFAULT_CP)
    # --json - or --markdown -: stdout carries that report alone, the text goes to stderr
    args.text_out = claim_stdout({"--json": args.json, "--markdown": args.markdown})
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    check_output_path("--json", args.json)
    check_output_path("--markdown", args.markdown)
    check_distinct_outputs(args.json, args.markdown)
    args.torchrun = _torchrun()
    from ..measure import device_type
    from . import environment
    environment.torch_npu_module()  # registers torch.npu, which the device choice reads
    args.cp_device = device_type(args.backend) if args.torchrun else "cpu"
    on_accel = args.cp_device != "cpu"
    chunks = 2 * args.cp_size
    args.check_seq_len = args.check_seq_len or chunks * math.ceil(CHECK_SEQ_LEN / chunks)
    args.check_heads = args.cp_size * math.ceil(CHECK_HEADS / args.cp_size)
    # Defaults round up to what every layout and ulysses can split; given values are checked.
    default = DEEPSEEK_V3 if on_accel else CPU_DEFAULT
    args.seq_len = args.seq_len or chunks * math.ceil(default.seq_len / chunks)
    args.heads = args.heads or args.cp_size * math.ceil(default.heads / args.cp_size)
    for flag, seq_len in (("--check-seq-len", args.check_seq_len), ("--seq-len", args.seq_len)):
        for layout in LAYOUTS:
            try:
                check_seq_len(seq_len, layout, args.cp_size)
            except ValueError as exc:
                raise ValueError(f"{flag}: {exc}") from None
    if args.heads % args.cp_size:
        raise ValueError(f"--heads {args.heads} is not divisible by CP {args.cp_size} "
                         "(ulysses splits heads); give a multiple of it")
    return args


# ---------------------------------------------------------------- CP runs

def cp_cases(args, dtype: str) -> List[Case]:
    from ..cases import Case
    shape = MLAShape(seq_len=args.check_seq_len, batch=1, heads=args.check_heads,
                     qk_head_dim=CPU_DEFAULT.qk_head_dim, rope_dim=CPU_DEFAULT.rope_dim,
                     v_head_dim=CPU_DEFAULT.v_head_dim, kv_lora_rank=CPU_DEFAULT.kv_lora_rank)
    runs = standard_runs(args.check_seq_len // 4, overlap=args.cp_size > 1)
    return [Case(spec=v, cp_algo=a, layout=DEFAULT_LAYOUT[a], kernel="auto", dtype=dtype, shape=shape)
            for a in CP_ALGOS for v in runs]


def bench_cases(args, dtype: str) -> List[Case]:
    from ..cases import Case
    base = DEEPSEEK_V3 if args.cp_device != "cpu" else CPU_DEFAULT
    shape = MLAShape(seq_len=args.seq_len, batch=1, heads=args.heads, qk_head_dim=base.qk_head_dim,
                     rope_dim=base.rope_dim, v_head_dim=base.v_head_dim, kv_lora_rank=base.kv_lora_rank)
    runs = standard_runs(max(args.seq_len // 4, 1), overlap=args.cp_size > 1)
    return [Case(spec=v, cp_algo=a, layout=DEFAULT_LAYOUT[a], kernel="auto", dtype=dtype, shape=shape)
            for a in CP_ALGOS for v in runs]


def bench_worker(rank: int, cp_size: int, cases: List[Case], repeat: int, warmup: int) -> List[dict]:
    """Per rank: every bench case through ``measure.run_on_rank``, figures only (no
    tensors travel back: at bench lengths they are large)."""
    import torch.distributed as dist
    from ..measure import run_on_rank
    group = dist.group.WORLD if dist.is_initialized() else None
    out = []
    for case in cases:
        r = run_on_rank(case, rank, cp_size, group, repeat, warmup, cpu_peak=True)
        out.append({"comm": r["comm"], "seconds": r["seconds"], "peak_bytes": r["peak_bytes"],
                    "saved_bytes": r["saved_bytes"]})
    return out


def _payload(result: dict, direction: str) -> int:
    return sum(v["payload"] for k, v in result["comm"].get(direction, {}).items() if k != "handshake")


def cp_rows(cases: List[Case], per_rank: List[List[dict]]) -> List[dict]:
    """Each case against the float64 reference, with rank 0's bytes per direction."""
    from .. import equivalence as eq
    rows, refs = [], {}
    for i, case in enumerate(cases):
        ranks = [r[i] for r in per_rank]
        key = (case.shape, case.dtype)
        if key not in refs:
            refs[key] = eq.reference(case)
        errors = eq.relative_errors(eq.assemble(ranks, case), refs[key])
        worst = max(errors.values())
        rows.append({"variant": case.spec.name, "form": case.form, "cp_algo": case.cp_algo,
                     "layout": case.layout, "dtype": case.dtype, "seq_len": case.shape.seq_len,
                     "heads": case.shape.heads, "options": dict(case.options), "errors": errors,
                     "max_rel_err": worst, "tolerance": TOLERANCE[case.dtype],
                     "passed": worst <= TOLERANCE[case.dtype],
                     "forward_bytes": _payload(ranks[0], "forward"),
                     "backward_bytes": _payload(ranks[0], "backward")})
    _vs_explicit(rows)
    return rows


def bench_rows(cases: List[Case], per_rank: List[List[dict]]) -> List[dict]:
    rows = []
    for i, case in enumerate(cases):
        ranks = [r[i] for r in per_rank]
        peaks = [r["peak_bytes"] for r in ranks if r["peak_bytes"] is not None]
        rows.append({"variant": case.spec.name, "form": case.form, "cp_algo": case.cp_algo,
                     "layout": case.layout, "dtype": case.dtype, "seq_len": case.shape.seq_len,
                     "heads": case.shape.heads, "options": dict(case.options),
                     "ms": 1e3 * max(r["seconds"] for r in ranks),
                     "peak_bytes": max(peaks) if peaks else None,
                     "saved_bytes": ranks[0]["saved_bytes"],
                     "forward_bytes": _payload(ranks[0], "forward"),
                     "backward_bytes": _payload(ranks[0], "backward")})
    _vs_explicit(rows)
    return rows


def _vs_explicit(rows: List[dict]) -> None:
    """Explicit's bytes over each row's, per direction, at the same cp_algo and dtype."""
    explicit = {(r["cp_algo"], r["dtype"]): r for r in rows if r["variant"] == "explicit"}
    for r in rows:
        ex = explicit.get((r["cp_algo"], r["dtype"]))
        for d in ("forward", "backward"):
            mine = r[f"{d}_bytes"]
            r[f"explicit_over_form_{d}"] = (ex[f"{d}_bytes"] / mine) if ex and mine else None


# ---------------------------------------------------------------- running

class RankError(RuntimeError):
    """A CP run raised on some rank; the message carries what each said."""


class Ranks:
    """Where the CP runs happen: this process's rank under torchrun, or spawned gloo ranks."""

    def __init__(self, args):
        self.args = args
        self.rank = 0
        self.dist = None
        if args.torchrun:
            import torch.distributed as dist
            from ..measure import default_backend, set_local_device
            backend = args.backend or default_backend()
            set_local_device(backend, int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend)
            self.dist, self.rank, self.backend = dist, dist.get_rank(), backend
            self.where = f"torchrun, {args.cp_size} ranks, backend {backend}"
        else:
            self.backend = "gloo"
            self.where = f"{args.cp_size} spawned gloo CPU ranks"
            from . import environment
            if environment.accelerator() != "cpu":
                self.where += " (launch with torchrun for the device's backend)"

    def run(self, fn, *fn_args) -> Optional[List]:
        """``fn(rank, cp_size, *fn_args)`` on every rank; every rank's result on rank 0.

        Raises :class:`RankError` (on rank 0) if a rank raised: under torchrun a
        rank that fails still joins the gather, so no rank waits for it forever."""
        if self.dist is None:
            from ..spawn import WorkerError, run_on_ranks
            try:
                return run_on_ranks(fn, self.args.cp_size, *fn_args, timeout_s=1800.0)
            except WorkerError as exc:
                raise RankError(str(exc)) from None
        try:
            mine = (True, fn(self.rank, self.args.cp_size, *fn_args))
        except Exception as exc:  # noqa: BLE001 - reported by rank 0
            mine = (False, f"rank {self.rank}: {type(exc).__name__}: {exc}")
        everyone = self.gather(mine)
        if everyone is None:
            return None
        errors = [r for ok, r in everyone if not ok]
        if errors:
            raise RankError("\n".join(errors))
        return [r for _, r in everyone]

    def gather(self, mine) -> Optional[List]:
        if self.dist is None:
            return [mine]
        everyone = [None] * self.args.cp_size
        self.dist.all_gather_object(everyone, mine)
        return everyone if self.rank == 0 else None

    def close(self):
        if self.dist is not None:
            if self.backend == "gloo":
                # No rank tears its group down while a peer still uses it: a rank that left
                # first once made gloo abort its peer at exit. Bounded, so a peer stuck in
                # another collective (rank 0 failed alone) makes this raise, not hang.
                try:
                    self.dist.monitored_barrier(timeout=timedelta(seconds=60))
                except RuntimeError:
                    pass  # the failure that brought us here is the one to report
            self.dist.destroy_process_group()


def run(args) -> int:
    resolve(args)
    ranks = Ranks(args)
    try:
        return _run(args, ranks)
    finally:
        ranks.close()


def _say(ranks, *lines):
    if ranks.rank == 0:
        print(*lines, sep="\n", file=ranks.args.text_out, flush=True)


def _run(args, ranks: Ranks) -> int:
    import torch
    from ..measure import worker as eq_worker
    from . import environment, exactness
    start = time.perf_counter()
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if args.torchrun else 0
    device = environment.local_device(local_rank)
    dtypes = [str(d).replace("torch.", "") for d in environment.dtypes_for(device)]
    env = environment.report() if ranks.rank == 0 else None
    paths = environment.laga_paths(device) if ranks.rank == 0 else None
    _say(ranks, f"doctor: exactness on {device} ({', '.join(dtypes)}); CP on {ranks.where}")

    kernels = environment.installed_kernels()
    npu_docs = any(KERNEL_TYPES[k].documents_need_build for k in kernels) and \
        environment.npu_documents_supported()
    if device.type == "npu":
        torch.npu.set_device(device)
    mine = exactness.run_all(exactness.plan(kernels, dtypes, npu_docs), device)
    exact = _merge_exactness(ranks.gather(mine))
    _say(ranks, f"exactness: {len(exact or [])} checks done")  # the summary gives the passes

    cp_dtypes = ["float32"] + (["bfloat16"] if args.cp_device != "cpu" else [])
    cases = [c for d in cp_dtypes for c in cp_cases(args, d)]
    errors = {}
    try:
        per_rank = ranks.run(eq_worker, cases, 1, 0)
        cp = cp_rows(cases, per_rank) if ranks.rank == 0 else []
    except RankError as exc:  # e.g. a kernel this node's stack rejects: a finding, not a crash
        cp, errors["cp"] = [], str(exc)
    _say(ranks, f"CP: {sum(r['passed'] for r in cp)}/{len(cases)} runs match the reference")

    bench = []
    if not args.no_bench:
        dtype = "bfloat16" if args.cp_device != "cpu" else "float32"
        bcases = bench_cases(args, dtype)
        _say(ranks, f"bench: {len(bcases)} runs at S={args.seq_len}, {args.heads} heads, {dtype}")
        try:
            per_rank = ranks.run(bench_worker, bcases, args.repeat, args.warmup)
            bench = bench_rows(bcases, per_rank) if ranks.rank == 0 else []
        except RankError as exc:
            errors["bench"] = str(exc)
    if ranks.rank != 0:
        return 0

    doc = {"environment": env, "laga_paths": paths,
           "run": {"exactness_device": str(device), "cp": ranks.where, "cp_size": args.cp_size,
                   "cp_device": args.cp_device, "check_seq_len": args.check_seq_len,
                   "bench_seq_len": None if args.no_bench else args.seq_len,
                   "repeat": args.repeat, "warmup": args.warmup,
                   "seconds": round(time.perf_counter() - start, 1)},
           "exactness": exact, "cp": cp, "bench": bench, "errors": errors}
    # A bench that cannot run (say, out of memory at --seq-len) is reported, not a mismatch.
    doc["passed"] = "cp" not in errors and bool(cp) and all(r["passed"] for r in exact + cp)
    doctor_report.print_summary(doc, args.text_out)
    _write(args, doc)
    return 0 if doc["passed"] else 1


def _merge_exactness(per_rank: Optional[List[List[dict]]]) -> Optional[List[dict]]:
    """One row per check: the worst rank's (every device must pass)."""
    if per_rank is None:
        return None
    merged = []
    for rows in zip(*per_rank):
        worst = max(rows, key=lambda r: (not r["passed"], r["max_rel_err"] or 0.0))
        merged.append(dict(worst, ranks_failed=[i for i, r in enumerate(rows) if not r["passed"]]))
    return merged


def _write(args, doc) -> None:
    if args.json == "-":
        print(json.dumps(doc, indent=1, default=str))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"JSON: {args.json}", file=args.text_out)
    if args.markdown == "-":
        print(doctor_report.markdown(doc), end="", flush=True)
    elif args.markdown:
        with open(args.markdown, "w") as f:
            f.write(doctor_report.markdown(doc))
        print(f"Markdown: {args.markdown} (attach it to an issue on the project's issue tracker)",
              file=args.text_out)

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
from typing import List, Optional

from ..torchrun_env import torchrun_rank, under_torchrun as _torchrun, world_size
from ...cp_algos import takes_ulysses_degree
from ...kernels.registry import CPU_KERNELS, KERNEL_TYPES, KERNELS, canonical, device_of
from ...vocab.names import LAYOUTS
from . import bench_dsa
from .output import check_output_path, claim_stdout, dtype_arg
from .parsers import add_cp_algo_args, command_parser
from .bench_fit import check_fits
# what tests and verify ask bench for, kept where they were
from .bench_print import (COLUMNS, hidden_share_text, overlap_text, peak_note,  # noqa: F401
                          print_document_trend, print_table)
from .bench_rows import make_rows
from .bench_runs import (as_cases, build_runs, hybrid_worker, parse_seq_lens,  # noqa: F401
                         plan_runs, ulysses_degree_from_args)
from .plot import check_plot_path, matplotlib_missing, write_plot
from .timing import speed_text, timing_conclusive  # noqa: F401  (tests ask bench for them)
from .shapes import CPU_DEFAULT, add_shape_args, positive_int, shape_from_args

DEFAULT_CP = 4
# Outputs not named on the command line go into this folder (made when needed), not the cwd.
DEFAULT_DIR = "bench_out"
DEFAULT_JSON = os.path.join(DEFAULT_DIR, "bench.json")
DEFAULT_PLOT = os.path.join(DEFAULT_DIR, "bench.png")
DEFAULT_DSA_JSON = os.path.join(DEFAULT_DIR, "bench_dsa.json")  # bench --dsa: not the dense bench's
# How long spawned ranks may take for the whole benchmark before they count as hung: a
# bench at model dims on CPU runs for many minutes, which is not a hang.
RUN_TIMEOUT_S = 3600.0


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
                   help=f"write every figure here (default {DEFAULT_JSON}, with --dsa "
                        f"{DEFAULT_DSA_JSON}, the folder made if needed; '-' = stdout only; '' = none)")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help=f"PNG plots (needs matplotlib: refused without it; default {DEFAULT_PLOT}, "
                        "skipped with a note at the start when matplotlib is missing; '-' = the PNG "
                        "on stdout; '' = none)")
    p.add_argument("--backend", default=None,
                   help="torchrun only (refused without it): process-group backend (default nccl "
                        "on CUDA, hccl on NPU, gloo)")
    add_shape_args(p, CPU_DEFAULT, seq_len=False)
    bench_dsa.add_args(p)



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
    cp_size = world_size(args.cp, args.backend, DEFAULT_CP)
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if bench_dsa.wanted(args):
        args.cp = cp_size
        return _run_dsa(args)
    plot_note = resolve_plot(args)
    out = claim_stdout({"--json": args.json, "--plot": args.plot})  # "-": stdout is that report's
    if args.json is None:
        args.json = DEFAULT_JSON
    check_plot_path(args.plot)
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path in (DEFAULT_JSON, DEFAULT_PLOT) and not os.path.isdir(DEFAULT_DIR):
            check_output_path(flag, DEFAULT_DIR)  # made when the run writes: its place is writable
        else:
            check_output_path(flag, path)
    torchrun = _torchrun()
    if torchrun:  # the device type is torch's to say
        from ..measure import device_type as measure_device_type
        device_type = measure_device_type(args.backend)
    else:
        device_type = "cpu"
    check_kernel(args.kernel, device_type, torchrun)
    planned, models = plan_runs(args, cp_size, device_type)
    check_fits(planned, models, int(os.environ.get("LOCAL_WORLD_SIZE", cp_size)) if torchrun else cp_size)
    # every check passed without torch: now the runs, the ranks and torch
    from ..spawn import run_on_ranks
    from ..measure import worker
    runs = as_cases(planned)
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
    if args.json is None:  # its own default file in the default folder, made when missing
        args.json = DEFAULT_DSA_JSON
        check_output_path("--json", DEFAULT_DIR if not os.path.isdir(DEFAULT_DIR) else DEFAULT_DSA_JSON)
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
        print(f"plot: {'stdout' if written == '-' else written}", file=out)
    if args.json == "-":
        print(json.dumps(doc, indent=1, default=str), flush=True)

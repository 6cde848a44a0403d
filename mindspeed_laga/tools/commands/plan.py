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

from .. import costmodel as cm
from ...kernels.registry import CPU_KERNELS, KERNEL_NAMES, canonical
from ...vocab.names import LAYOUTS
from .output import dtype_arg, finite_float
from . import plan_dsa, plan_fsdp2
from .parsers import add_cp_algo_args, command_parser
from .plan_args import DEFAULT_CP, DIM_FLAGS, DTYPES
from .plan_build import build_plan
from .plan_print import print_plan

KERNEL_CHOICES = KERNEL_NAMES + ("both",)


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
                   help="device memory for the fit check (needs --num-layers)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="attention layers held by one device: the recommendation's figures per "
                        "iteration (and, with --device-memory, the fit check)")
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
    plan_fsdp2.add_args(p)  # last: it refuses the flags added before it does not model

def run(args) -> int:
    if plan_fsdp2.wanted(args):
        return plan_fsdp2.run(args)
    plan_fsdp2.refuse_elsewhere(args)
    if plan_dsa.wanted(args):
        return plan_dsa.run(args, DIM_FLAGS, DTYPES, DEFAULT_CP)
    plan = build_plan(args)
    plan["show_terms"] = bool(args.terms)
    if args.json:
        print(json.dumps({k: v for k, v in plan.items() if k != "recommendation_rows"}, indent=1))
    else:
        print_plan(plan)
    return 0

"""``plan``'s arguments turned into the cost model's configuration: dims, CP and its
default, the checks that refuse a bad size or pair in one line, the links and nodes."""
from __future__ import annotations

from dataclasses import replace
from typing import List

from .. import costmodel as cm
from ..runspec import standard_runs
from ...cp_algos import algo, takes_ulysses_degree
from ...kernels.registry import CPU_KERNELS
from ...vocab.names import CP_ALGOS
from ...vocab.dims import ModelDims
from .output import DTYPE_SPELLINGS
from .shapes import HEAD_DIMS, SizeFlag, check_seq_len_bound

# plan models accelerator ranks: a kernel's cost-model kind there (torch SDPA: flash-style)
DEVICE_TYPE = "accelerator"
DTYPES = DTYPE_SPELLINGS  # every command's one dtype vocabulary
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
    if args.device_memory is not None and args.num_layers is None:
        raise ValueError("--device-memory needs --num-layers (the fit check counts the layers "
                         "one device holds)")
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


def kernels_from_args(args) -> List[str]:
    return list(CPU_KERNELS) if args.kernel == "both" else [args.kernel]


def cluster_from_args(args) -> cm.Cluster:
    base = cm.CLUSTERS["910b"]
    cluster = replace(base, intra_gbps=args.intra_node_bandwidth or base.intra_gbps,
                      inter_gbps=args.inter_node_bandwidth or base.inter_gbps,
                      tflops=args.device_tflops or base.tflops,
                      devices_per_node=args.devices_per_node or base.devices_per_node)
    return cluster if cluster == base else replace(cluster, name="custom")


"""``mindspeed-laga plan --backend fsdp2``: MindSpeed-LLM's FSDP2 backend, its context
parallelism against LAGA's (``costmodel/fsdp2.py``).

Per layer and per CP rank, forward: collectives, values per token and the bytes a rank
receives, for HF DeepSeek-V3 (``--preset deepseek-v3``, ``--cp-type ulysses|ring``) or
GLM-5/5.2 (``--dsa glm-5.2``); for GLM also the tensors with two dims of the full sequence
the host's path makes on every rank (its ``[b, S, S]`` mask and boolean copy, its indexer's
scores), where LAGA makes none. It models ``MODELLED``'s flags; any other plan flag given is
refused in one line. Nothing runs.
"""
from __future__ import annotations

import json
import textwrap
from dataclasses import replace

from ..costmodel import fsdp2
from ..costmodel.config import DTYPE_BYTES
from ..costmodel.presets import FSDP2_MODELS, MODELS
from .output import fmt_bytes, mix_line
from .plan_args import DEFAULT_CP, DIM_FLAGS, DTYPES
from .plan_dsa import _parsed_default as parsed_default
from .shapes import check_seq_len_bound
from .typed import given, typed_outside

BACKENDS = ("megatron", "fsdp2")
WIDTH = 100  # plan's lines fit a 100-column terminal
MODELLED = ("backend", "cp_type", "preset", "dsa", "index_heads", "index_head_dim", "seq_len",
            "micro_batch", "cp", "dtype", "json") + tuple(d.dest for d in DIM_FLAGS)


def add_args(p) -> None:
    """Call last: every plan flag added before is one this mode refuses unless modelled."""
    g = p.add_argument_group("MindSpeed-LLM's FSDP2 backend (train_fsdp2.py)")
    g.add_argument("--backend", choices=BACKENDS, default=None,
                   help="megatron (default: pretrain_gpt.py) or fsdp2: the FSDP2 backend's CP "
                        f"against LAGA's, forward, for {', '.join(sorted(FSDP2_MODELS))} "
                        "(--preset, or --dsa for GLM), with the host's sequence-square tensors")
    g.add_argument("--cp-type", choices=tuple(fsdp2.CP_TYPES), default=None,
                   help="with --backend fsdp2: its parallel.cp_type (default ulysses); LAGA "
                        "maps ulysses to its ulysses algorithm and ring to allgather")
    p.set_defaults(fsdp2_unmodelled=tuple(
        (a.dest, a.option_strings[0], parsed_default(a)) for a in p._actions
        if a.option_strings and a.dest not in MODELLED + ("help",)))


def _say(text: str, indent: str = "") -> None:
    print(textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "    ",
                        break_on_hyphens=False))


def wanted(args) -> bool:
    return args.backend == "fsdp2"


def refuse_elsewhere(args) -> None:
    """--cp-type belongs to --backend fsdp2 only."""
    if given(args, "cp_type") and not wanted(args):
        raise ValueError(f"--cp-type {args.cp_type} is the FSDP2 backend's parallel.cp_type; add "
                         "--backend fsdp2 (the Megatron backend's CP algorithm is --cp-algo)")


def _model(args) -> str:
    name = args.dsa if args.dsa is not None else args.preset
    if name not in FSDP2_MODELS:
        dense = sorted(n for n in FSDP2_MODELS if not MODELS[n].sparse)
        sparse = sorted(n for n in FSDP2_MODELS if MODELS[n].sparse)
        flag = "--dsa" if args.dsa is not None else "--preset"
        raise ValueError(f"{flag} {name}: LAGA on the FSDP2 backend covers --preset "
                         f"{'/'.join(dense)} and --dsa {'/'.join(sparse)}; use one, or drop "
                         "--backend fsdp2")
    return name


def _check(args) -> None:
    typed = typed_outside(args, getattr(args, "fsdp2_unmodelled", ()))
    if args.dsa is not None and given(args, "preset"):
        typed.append("--preset")
    if typed:
        raise ValueError(f"plan --backend fsdp2 models {', '.join(_flags())} only; drop "
                         f"{', '.join(typed)}")
    for flag in ("seq_len", "micro_batch", "cp", "index_heads", "index_head_dim"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    check_seq_len_bound("--seq-len", args.seq_len)
    if args.dsa is None and (given(args, "index_heads") or given(args, "index_head_dim")):
        raise ValueError("--index-heads/--index-head-dim size GLM's indexer; add --dsa glm-5.2")


def _flags():
    return ["--" + d.replace("_", "-") for d in MODELLED if d not in ("backend",)]


def table_from_args(args) -> dict:
    _check(args)
    name = _model(args)
    preset = MODELS[name]
    dims = replace(preset.dims, **{d.field: getattr(args, d.dest) for d in DIM_FLAGS
                                   if getattr(args, d.dest) is not None})
    index = preset.indexer
    if index is not None:
        index = replace(index, **{k: v for k, v in (("heads", args.index_heads),
                                                    ("head_dim", args.index_head_dim)) if v is not None})
    cp = DEFAULT_CP if args.cp is None else args.cp
    dtype = DTYPES[args.dtype]
    table = fsdp2.fsdp2_table(dims, args.seq_len, cp, args.micro_batch, DTYPE_BYTES[dtype],
                              args.cp_type or "ulysses", index, preset.share)
    table.update(model=name, model_type=FSDP2_MODELS[name], dtype=dtype, dims=vars(dims))
    return table


def run(args) -> int:
    table = table_from_args(args)
    if args.json:
        print(json.dumps({"fsdp2": table}, indent=1))
    else:
        print_table(table)
    return 0


def print_table(t: dict) -> None:
    d = t["dims"]
    _say(f"plan --backend fsdp2 {t['model']} ({t['model_type']}): n={d['heads']} "
         f"d_n={d['qk_head_dim']} d_r={d['rope_dim']} d_v={d['v_head_dim']} "
         f"d_c={d['kv_lora_rank']} hidden={d['hidden_size']} q_lora={d['q_lora_rank']}")
    _say(f"S={t['seq_len']}, b={t['micro_batch']}, CP={t['cp_size']}, parallel.cp_type "
         f"{t['cp_type']} (LAGA: {t['laga_cp_algo']}), {t['dtype']}; forward, per layer and per "
         "CP rank (model)")
    print(f"{'path':<22} {'collectives':>12} {'values/token':>14} {'received':>12}")
    print("-" * 63)
    for name, row in t["paths"].items():
        print(f"{name:<22} {row['collectives']:>12} {row['values_per_token']:>14,} "
              f"{fmt_bytes(row['received_bytes']):>12}")
        _say("; ".join(f"{x['kind']} {x['what']} {x['width']:,}" for x in row["transfers"]), "    ")
    host, laga = list(t["paths"].values())[:2]
    if laga["received_bytes"]:
        print(f"host / laga: {host['received_bytes'] / laga['received_bytes']:.2f}x the bytes")
    if "layer_mix" in t:
        _say(mix_line(t["layer_mix"]))
    if "host_squares" in t:
        _print_squares(t)
    _say("received: bytes one rank receives (= sends): all-gather and ring (P-1) x the local "
         "payload, all-to-all (P-1)/P x.")


def _print_squares(t: dict) -> None:
    s, dtype, heads = t["host_squares"], t["dtype"], t["index_heads"]
    _say(f"tensors with two dims of the full sequence, per rank (the host builds them on every "
         f"rank; LAGA: none, {fmt_bytes(t['laga_squares'])}):")
    for what, key in ((f"index mask [b, S, S] {dtype}", "index_mask"),
                      ("its bool copy [b, S, S]", "index_mask_bool"),
                      ("mask peak (both alive)", "mask_peak"),
                      (f"indexer scores [b, S, {heads}, S] float32", "indexer_scores")):
        print(f"  {what:<40} {fmt_bytes(s[key]):>12}")

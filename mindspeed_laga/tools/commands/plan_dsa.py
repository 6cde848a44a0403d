"""``mindspeed-laga plan --dsa MODEL``: sparse MLA's collectives, host paths against LAGA.

Per layer and per CP rank: the host's kvallgather path (seven all-gathers), its ulysses
path (gathers and all-to-alls) and LAGA's one gather of ``[kv_latent | k_pos_emb |
index_key]``, forward and backward: collectives, values per token and the bytes a rank
receives (``costmodel/dsa.py``), then one recommendation (``recommend_dsa.py``): the path,
its MindSpeed-LLM flags, its collectives' time and bytes against the host's path, and why.
It models ``MODELLED``'s flags; any other plan flag given is refused in one line rather than
ignored. Nothing runs.
"""
from __future__ import annotations

import json
import textwrap
from dataclasses import replace

from ..costmodel import dsa
from ..costmodel.config import DTYPE_BYTES
from . import recommend_dsa
from .output import fmt_bytes, mix_line
from .shapes import check_seq_len_bound
from .typed import typed_outside

# The plan flags (argparse dests) --dsa models; every other plan flag given is refused.
MODELLED = ("dsa", "index_heads", "index_head_dim", "seq_len", "micro_batch", "cp", "tp", "dtype",
            "link_bandwidth", "heads", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
            "kv_lora_rank", "hidden_size", "terms", "json")
DIRECTIONS = ("forward", "backward")
WIDTH = 100  # plan's tables fit a 100-column terminal


def _say(text: str, indent: str = "") -> None:
    print(textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "    "))


def add_args(p) -> None:
    g = p.add_argument_group("sparse MLA (DSA)")
    g.add_argument("--dsa", choices=sorted(dsa.DSA_PRESETS), default=None, metavar="MODEL",
                   help="show sparse MLA's collectives instead: the host's kvallgather and ulysses "
                        "paths against LAGA's one gather, with MODEL's dims "
                        f"({', '.join(sorted(dsa.DSA_PRESETS))}; the dim flags override), ending "
                        f"in one recommendation; it models {modelled_flags()} and refuses "
                        "every other plan flag")
    g.add_argument("--index-heads", type=int, default=None,
                   help="the indexer's heads, --index-n-heads (DeepSeek-V3.2: 64, GLM-5: 32)")
    g.add_argument("--index-head-dim", type=int, default=None, help="the indexer's head dim (128)")
    # every other flag of plan's, with its real name and its parsed default: given, refused
    p.set_defaults(dsa_unmodelled=tuple((a.dest, a.option_strings[0], _parsed_default(a))
                                        for a in p._actions
                                        if a.option_strings and a.dest not in MODELLED + ("help",)))


def _parsed_default(action):
    """The value argparse stores when the flag is not given (a string default goes through
    the flag's type)."""
    if isinstance(action.default, str) and action.type is not None:
        return action.type(action.default)
    return action.default


def modelled_flags() -> str:
    return ", ".join("--" + d.replace("_", "-") for d in MODELLED if d not in ("dsa",))


def wanted(args) -> bool:
    return args.dsa is not None


def table_from_args(args, dim_flags, dtypes, default_cp) -> dict:
    _check(args)
    dims, index = dsa.dsa_preset(args.dsa)
    dims = replace(dims, **{d.field: getattr(args, d.dest) for d in dim_flags
                            if getattr(args, d.dest) is not None})
    index = replace(index, **{k: v for k, v in (("heads", args.index_heads),
                                                ("head_dim", args.index_head_dim)) if v is not None})
    cp = default_cp if args.cp is None else args.cp
    table = dsa.dsa_table(dims, index, args.seq_len, cp, args.micro_batch,
                          DTYPE_BYTES[dtypes[args.dtype]], dsa.DSA_SHARES.get(args.dsa))
    table.update(model=args.dsa, dtype=dtypes[args.dtype], dims=vars(dims))
    table["recommendation"] = recommend_dsa.recommend(table, dims.heads, args.link_bandwidth)
    return table


def _check(args) -> None:
    given = typed_outside(args, getattr(args, "dsa_unmodelled", ()))
    if given:
        raise ValueError(f"plan --dsa models {modelled_flags()} only; drop {', '.join(given)} "
                         f"(dense-plan flags; --dsa {args.dsa} names the model and its dims)")
    if args.tp != 1:
        raise ValueError(f"--dsa models TP 1 (every head on the rank); drop --tp {args.tp}")
    for flag in ("seq_len", "micro_batch", "cp", "index_heads", "index_head_dim", "link_bandwidth"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    check_seq_len_bound("--seq-len", args.seq_len)


def run(args, dim_flags, dtypes, default_cp) -> int:
    table = table_from_args(args, dim_flags, dtypes, default_cp)
    if args.json:
        print(json.dumps({"dsa": table}, indent=1))
    else:
        print_table(table, args.terms)
    return 0


def print_table(t: dict, terms: bool) -> None:
    d = t["dims"]
    print(f"plan --dsa {t['model']}: n={d['heads']} d_n={d['qk_head_dim']} d_r={d['rope_dim']} "
          f"d_v={d['v_head_dim']} d_c={d['kv_lora_rank']} hidden={d['hidden_size']}, indexer "
          f"{t['index_heads']} x {t['index_head_dim']}")
    print(f"S={t['seq_len']}, b={t['micro_batch']}, CP={t['cp_size']}, TP=1, {t['dtype']}; "
          "per layer and per CP rank (model)")
    print(f"{'path':<18} {'collectives':>12} {'values/token':>14} {'received':>12} "
          f"{'collectives':>12} {'values/token':>14} {'received':>12}")
    print(f"{'':<18} {'fwd':>12} {'fwd':>14} {'fwd':>12} {'bwd':>12} {'bwd':>14} {'bwd':>12}")
    print("-" * 100)
    for name, row in t["paths"].items():
        print(f"{name:<18}" + "".join(f" {row[w]['collectives']:>12} {row[w]['values_per_token']:>14,} "
                                      f"{fmt_bytes(row[w]['received_bytes']):>12}" for w in DIRECTIONS))
    laga = t["paths"]["laga"]["forward"]
    for name, row in t["paths"].items():
        if name != "laga" and laga["received_bytes"]:  # CP=1 exchanges nothing: no ratio
            f = row["forward"]
            print(f"forward, {name} / laga: {f['received_bytes'] / laga['received_bytes']:.2f}x the bytes, "
                  f"{f['collectives']} collectives instead of {laga['collectives']}")
    if "layer_mix" in t:  # a model whose layers share picks
        _say(mix_line(t["layer_mix"]))
    if terms:
        for name, row in t["paths"].items():
            for w in DIRECTIONS:
                cells = "; ".join(f"{x['kind']} {x['what']} {x['width']:,}" for x in row[w]["transfers"])
                _say(f"{name} {w}: {cells}", "  ")
    _say("received: bytes one rank receives (= sends): all-gather and reduce-scatter (P-1) x the local "
         "payload, all-to-all (P-1)/P x; the host's ulysses path is its non-absorbed one.")
    recommend_dsa.print_recommendation(t["recommendation"], fmt_bytes, WIDTH)

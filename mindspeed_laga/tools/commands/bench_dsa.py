"""``mindspeed-laga bench --dsa MODEL``: LAGA's sparse MLA measured on spawned CP ranks.

Runs ``sparse_laga_attention`` (indexer top-k, absorbed attention over the picked keys,
the indexer's KL loss) forward+backward on P gloo CPU ranks for each sequence length and
puts the byte counter's collectives beside the cost model's (``costmodel/dsa.py``): the
gather's widths are the model's own (d_c, d_r and the index head dim), the heads are the
shape flags' (they stay local and move nothing). The host's two DSA paths run NPU ops,
so they appear as model figures at the same S and CP. No plot. It takes ``TAKEN``'s flags;
any other bench flag given (the dense forms' documents, kernels, algorithms, block size,
latent and rope widths: the gather's widths are MODEL's) is refused in one line. A length
whose ranks would not fit this machine's memory is refused before any rank starts.
"""
from __future__ import annotations

import json
import statistics
import sys
import textwrap
import time

from ..costmodel import dsa
from ..costmodel.config import DTYPE_BYTES
from ...vocab.names import SEQUENCE_LAYOUTS
from .bench_fit import available_bytes, refuse_past
from .output import check_output_path, mix_line
from .typed import typed_outside

LAYOUTS = SEQUENCE_LAYOUTS  # one unbroken sequence: no documents here
# The bench flags (argparse dests) --dsa takes; every other bench flag given is refused.
TAKEN = ("dsa", "index_topk", "sparse_kernel", "cp", "seq_lens", "layout", "dtype", "repeat",
         "warmup", "json",
         "plot", "heads", "qk_head_dim", "v_head_dim", "micro_batch")
# Host bytes a rank's torch sparse path holds at its peak per (query, key) pair: two float32
# [b, H, s, S] copies of the indexer's scores (8 B per index head) and about 22 B of the
# [b, s, S] sort's values and indices and the masks (measured at CP 1: 53.7 B x S^2 with 4
# index heads).
PEAK_BYTES_PER_PAIR_AND_INDEX_HEAD = 8
PEAK_BYTES_PER_PAIR = 22
RUN_TIMEOUT_S = 1800.0
HOST_KEYS = ("collectives", "values_per_token", "received_bytes")


def add_args(p) -> None:
    g = p.add_argument_group("sparse MLA (DSA)")
    g.add_argument("--dsa", choices=sorted(dsa.DSA_PRESETS), default=None, metavar="MODEL",
                   help="measure LAGA's sparse MLA instead, with MODEL's gather widths "
                        f"({', '.join(sorted(dsa.DSA_PRESETS))}); layout zigzag or contiguous; "
                        "it takes --cp, --seq-lens, --layout, --dtype, --repeat, --warmup, --json, "
                        "--heads, --qk-head-dim, --v-head-dim, --micro-batch, --index-topk and "
                        "--sparse-kernel and "
                        "refuses every other bench flag")
    g.add_argument("--index-topk", type=int, default=64,
                   help="keys each query picks (--dsa; default 64)")
    g.add_argument("--sparse-kernel", default="torch", metavar="KERNEL",
                   help="the sparse stage kernel every stage runs (--dsa; default torch): a name "
                        "of sparse/registry.py's SPARSE_KERNELS, checked before any rank starts")
    # every other flag of bench's, with its real name and its parsed default: given, refused
    p.set_defaults(dsa_not_taken=tuple((a.dest, a.option_strings[0], _parsed_default(a))
                                       for a in p._actions
                                       if a.option_strings and a.dest not in TAKEN + ("help",)))


def _parsed_default(action):
    if isinstance(action.default, str) and action.type is not None:
        return action.type(action.default)
    return action.default


def wanted(args) -> bool:
    return args.dsa is not None


def check(args, seq_lens) -> None:
    given = typed_outside(args, getattr(args, "dsa_not_taken", ()))
    if given:
        taken = ", ".join("--" + d.replace("_", "-") for d in TAKEN if d not in ("dsa", "plot"))
        raise ValueError(f"bench --dsa takes {taken} only; drop {', '.join(given)} (dense-bench "
                         "flags; the gather's widths are the model's)")
    if args.layout not in (None,) + LAYOUTS:
        raise ValueError(f"bench --dsa --layout must be one of {LAYOUTS}, got {args.layout!r}")
    if args.index_topk <= 0:
        raise ValueError(f"--index-topk must be positive, got {args.index_topk}")
    for s in seq_lens:
        if s % (2 * args.cp):
            raise ValueError(f"--seq-lens {s} must be a multiple of 2 x --cp ({2 * args.cp})")


def rank_peak_bytes(seq_len: int, cp: int, batch: int, index_heads: int) -> int:
    """Host bytes one spawned rank holds at its peak: its queries' pairs with every key."""
    pairs = batch * (seq_len // cp) * seq_len
    return pairs * (PEAK_BYTES_PER_PAIR_AND_INDEX_HEAD * index_heads + PEAK_BYTES_PER_PAIR)


def check_fits(seq_lens, cp: int, batch: int, index_heads: int, available=None) -> None:
    """The dense bench's cap: every spawned rank at its peak against MemAvailable."""
    available = available_bytes() if available is None else available
    longest = max(seq_lens)
    refuse_past(cp * rank_peak_bytes(longest, cp, batch, index_heads), available, longest,
                f"{cp} ranks, each with float32 indexer scores for its queries against all "
                f"{longest} keys, {index_heads} index heads: S x S pairs in all, whatever --cp")


def check_kernel(name: str, widths, shape, topk: int) -> None:
    """--sparse-kernel: a registered sparse stage kernel that runs every stage at these
    dims here (ValueError naming the flag and the fix, before any rank starts)."""
    from ...sparse.registry import sparse_kernel
    from ...sparse.stage import STAGES, SparseDims
    kernel = sparse_kernel(name, "--sparse-kernel")
    d_c, d_r, index_heads, index_dim = widths
    dims = SparseDims(d_c, d_r, index_dim, shape.heads, shape.heads, index_heads, topk)
    for stage in STAGES:
        kernel.check(stage, "--sparse-kernel", dims)


def worker(rank, world_size, widths, shape, seq_len, layout, topk, dtype, repeat, warmup,
           reusing=False, kernel="torch"):
    """One rank: seeded local inputs, ``warmup + repeat`` calls; the last call's records.
    ``reusing``: the calls take the picks of one earlier call as given (a layer reusing
    another's, GLM-5.2): no index inputs, no loss."""
    import torch
    import torch.distributed as dist
    from ... import count_bytes, sparse_laga_attention

    d_c, d_r, index_heads, index_dim = widths
    s, b, n = seq_len // world_size, shape.batch, shape.heads
    g = torch.Generator().manual_seed(rank)

    def randn(*size):
        return torch.randn(*size, generator=g).to(getattr(torch, dtype)).requires_grad_()

    x = [randn(s, b, n, shape.qk_head_dim + d_r), randn(s, b, d_c), randn(s, b, d_r),
         randn(n * (shape.qk_head_dim + shape.v_head_dim), d_c), randn(s, b, index_heads, index_dim),
         randn(s, b, index_dim), randn(s, b, index_heads)]
    options = dict(index_topk=topk, softmax_scale=(shape.qk_head_dim + d_r) ** -0.5,
                   qk_head_dim=shape.qk_head_dim, v_head_dim=shape.v_head_dim,
                   cp_group=dist.group.WORLD, layout=layout, indexer_kernel=kernel,
                   attention_kernel=kernel, loss_kernel=kernel)
    picks = None
    if reusing:  # the computing layer's picks, outside the timed and counted calls
        with torch.no_grad():
            picks = sparse_laga_attention(*x, **options).topk_indices
        x = x[:4] + [None] * 3
    seconds, records = [], []
    for i in range(warmup + repeat):
        start = time.perf_counter()
        with count_bytes() as counter:
            got = sparse_laga_attention(*x, **options, topk_indices=picks,
                                        indexer_loss_coeff=None if reusing else 1.0)
            loss = got.output.float().sum()
            (loss if reusing else loss + got.indexer_loss).backward()
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
        records = [(r.kind, r.direction, r.payload, r.wire) for r in counter.records]
    return {"seconds": statistics.median(seconds), "records": records}


def measured(records, direction: str) -> dict:
    """The data collectives of one call in ``direction`` (the ranks' agreement, one small
    exchange per micro-batch, is not the layer's traffic the model prices)."""
    own = [r for r in records if r[1] == direction and r[0] != "handshake"]
    return {"collectives": len(own), "payload_bytes": sum(r[2] for r in own),
            "wire_bytes": sum(r[3] for r in own)}


def make_row(per_rank, dims, index, seq_len, cp, batch, elem, reusing=False) -> dict:
    """One length's measured collectives beside the model's: LAGA's computing layer, or
    (``reusing``) its layer with given picks."""
    table = dsa.dsa_table(dims, index, seq_len, cp, batch, elem)["paths"]
    tokens = seq_len // cp * batch
    laga = dsa.path_row(dsa.laga_reusing(dims), tokens, cp, elem) if reusing else table["laga"]
    row = {"seq_len": seq_len, "ms": 1e3 * max(r["seconds"] for r in per_rank),
           "layer": "reusing" if reusing else "computing",
           "host_model": {name: {d: {k: p[d][k] for k in HOST_KEYS} for d in ("forward", "backward")}
                          for name, p in table.items() if name != "laga"}}
    for d in ("forward", "backward"):
        got = measured(per_rank[0]["records"], d)
        model = laga[d]
        same = (got["wire_bytes"], got["collectives"]) == (model["received_bytes"], model["collectives"])
        row[d] = {**got, "values_per_token": got["payload_bytes"] // (tokens * elem),
                  "model_values_per_token": model["values_per_token"],
                  "model_wire_bytes": model["received_bytes"], "model_collectives": model["collectives"],
                  "counter_equals_model": same}
    return row


def run(args, seq_lens, shape) -> int:
    from ..torchrun_env import under_torchrun
    if under_torchrun():
        raise ValueError("bench --dsa spawns its own gloo ranks: run it without torchrun")
    check(args, seq_lens)
    check_output_path("--json", args.json)
    dims, index = dsa.dsa_preset(args.dsa)
    check_fits(seq_lens, args.cp, shape.batch, index.heads)
    widths = (dims.kv_lora_rank, dims.rope_dim, index.heads, index.head_dim)
    check_kernel(args.sparse_kernel, widths, shape, args.index_topk)  # the registry imports torch
    from ..spawn import run_on_ranks
    layout = args.layout or "zigzag"
    elem = DTYPE_BYTES[args.dtype]
    out = sys.stderr if args.json == "-" else sys.stdout
    _say(f"bench --dsa {args.dsa}: {args.cp} spawned gloo CPU ranks, layout {layout}, {args.dtype}; "
         f"gather widths d_c={dims.kv_lora_rank}, d_r={dims.rope_dim}, index {index.heads} x "
         f"{index.head_dim}; n={shape.heads}, d_n={shape.qk_head_dim}, d_v={shape.v_head_dim}, "
         f"b={shape.batch}, top-k {args.index_topk}, sparse kernel {args.sparse_kernel}; "
         f"{args.warmup} warm-up + {args.repeat} timed", out)
    share = dsa.DSA_SHARES.get(args.dsa)
    rows = []
    for reusing in (False, True) if share else (False,):  # a sharing model: both layer kinds
        for s in seq_lens:
            per_rank = run_on_ranks(worker, args.cp, widths, shape, s, layout, args.index_topk,
                                    args.dtype, args.repeat, args.warmup, reusing,
                                    args.sparse_kernel, timeout_s=RUN_TIMEOUT_S)
            rows.append(make_row(per_rank, dims, index, s, args.cp, shape.batch, elem, reusing))
    print_rows(rows, out)
    doc = {"dsa": args.dsa, "cp_size": args.cp, "layout": layout, "dtype": args.dtype,
           "sparse_kernel": args.sparse_kernel, "rows": rows}
    if share:
        doc["layer_mix"] = dsa.layer_mix(dims, index, share)
        print_mix(doc["layer_mix"], out)
    if args.json and args.json != "-":
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"JSON: {args.json}", file=out)
    if args.json == "-":
        print(json.dumps(doc, indent=1), flush=True)
    return 0


def print_rows(rows, out) -> None:
    print(f"{'layer':>9} {'S':>8} {'coll fwd/bwd':>12} {'values/token':>12} {'wire fwd':>12} "
          f"{'model fwd':>12} {'wire bwd':>12} {'model bwd':>12} {'= model':>8} {'ms':>8}", file=out)
    for r in rows:
        f, b = r["forward"], r["backward"]
        same = "yes" if f["counter_equals_model"] and b["counter_equals_model"] else "NO"
        print(f"{r['layer']:>9} {r['seq_len']:>8} {f['collectives']:>5} / {b['collectives']:<4} "
              f"{f['values_per_token']:>12,} "
              f"{f['wire_bytes']:>12,} {f['model_wire_bytes']:>12,} {b['wire_bytes']:>12,} "
              f"{b['model_wire_bytes']:>12,} {same:>8} {r['ms']:>8.1f}", file=out)
    for name, host in rows[-1]["host_model"].items():
        f = host["forward"]
        _say(f"model, {name} at S={rows[-1]['seq_len']}: {f['collectives']} collectives, "
             f"{f['values_per_token']:,} values/token, {f['received_bytes']:,} bytes received forward", out)
    _say("wire: bytes rank 0 sends (= receives) per layer, the byte counter's measure; model: "
         "costmodel/dsa.py's LAGA row; values/token: the forward payload per local token.", out)


def print_mix(mix: dict, out) -> None:
    _say(mix_line(mix), out)


def _say(text: str, out) -> None:
    print(textwrap.fill(text, 100, subsequent_indent="    "), file=out)

"""``plan --dsa``'s answer: one CP path for sparse MLA, its MindSpeed-LLM flags, what it moves
and how long its collectives take against the host's paths, and why.

The candidates are the host's two DSA paths (``kvallgather_cp_algo``, ``ulysses_cp_algo``)
and LAGA's one gather. Every path computes the same picks and the same sparse attention, so
they differ by their collectives: the time compared is the collectives' (bytes a rank
receives forward and backward over the link), the compute is left out and said so. LAGA
runs under the host's kvallgather_cp_algo (its zigzag split into 2 x CP chunks balances the
causal work), or under ulysses_cp_algo (contiguous: CP chunks) where S does not cut into
2 x CP chunks; both gather the same 704 values.
Pure Python (no torch).
"""
from __future__ import annotations

import math
import textwrap
from typing import Callable, Dict, Optional

from ..costmodel import MACHINES, Machine

# The MindSpeed-LLM flags that select each path (features/dsa_checks.py accepts these).
PATH_FLAGS = {
    "host kvallgather": "--context-parallel-algo kvallgather_cp_algo",
    "host ulysses": "--context-parallel-algo ulysses_cp_algo",
    "laga": "--context-parallel-algo kvallgather_cp_algo --mla-latent-all-gather",
}
# LAGA where S is a multiple of CP but not of 2 x CP (the zigzag split's chunks)
LAGA_CONTIGUOUS = "--context-parallel-algo ulysses_cp_algo --mla-latent-all-gather"
NODE = 8  # devices of a 910B node: a CP group past it crosses nodes


def link_for(cp: int, link_gbps: Optional[float]) -> Machine:
    """--link-bandwidth when given, else 910B's intra-node link inside one node and its
    cross-node link past it."""
    if link_gbps is not None:
        return Machine("custom", link_gbps, MACHINES["910b-intra-node"].tflops)
    return MACHINES["910b-intra-node" if cp <= NODE else "910b-cross-node"]


def link_basis(cp: int, machine: Machine) -> str:
    if machine.name == "custom":
        return f"a {machine.link_gbps:g} GB/s link per rank (--link-bandwidth)"
    nodes = math.ceil(cp / NODE)
    where = (f"CP={cp} fits one 910B node of {NODE}" if nodes == 1
             else f"CP={cp} spans {nodes} 910B nodes of {NODE}")
    return f"the {machine.name} link, {machine.link_gbps:g} GB/s per rank: {where}"


def ulysses_refusal(heads: int, cp: int) -> Optional[str]:
    """Why the host's ulysses path cannot split these heads, or None."""
    if heads % cp:
        return f"the host's ulysses path splits the {heads} heads over CP={cp}, which does not divide them"
    return None


def recommend(table: dict, heads: int, link_gbps: Optional[float] = None) -> dict:
    """The answer for ``dsa_table``'s ``table`` (JSON-able)."""
    cp = table["cp_size"]
    machine = link_for(cp, link_gbps)
    rows: Dict[str, dict] = {}
    mix = table.get("layer_mix")
    for name, row in table["paths"].items():
        received = sum(row[d]["received_bytes"] for d in ("forward", "backward"))
        if mix:  # the mean layer of the model's mix of computing and reusing layers
            reuse = sum(table["reusing_paths"][name][d]["received_bytes"] for d in ("forward", "backward"))
            received = (mix["computing"] * received + mix["reusing"] * reuse) / mix["layers"]
        rows[name] = {"path": name, "flags": PATH_FLAGS[name], "received_bytes": received,
                      "collectives": sum(row[d]["collectives"] for d in ("forward", "backward")),
                      "values_per_token": row["forward"]["values_per_token"],
                      "values_per_token_backward": row["backward"]["values_per_token"],
                      "comm_s": received / (machine.link_gbps * 1e9)}
    if table["seq_len"] % (2 * cp):
        rows["laga"]["flags"] = LAGA_CONTIGUOUS
    refused = ulysses_refusal(heads, cp)
    if refused:
        rows["host ulysses"]["refused"] = refused
    hosts = [r for n, r in rows.items() if n != "laga" and "refused" not in r]
    host = min(hosts, key=lambda r: r["comm_s"])
    best = rows["laga"] if cp > 1 and rows["laga"]["comm_s"] <= host["comm_s"] else host
    basis = link_basis(cp, machine)
    if mix:
        basis += (f"; on the layer mix, {mix['computing']} of {mix['layers']} layers computing "
                  "their picks, the rest reusing them: the mean layer")
    return {"cp_size": cp, "basis": basis, "link_gbps": machine.link_gbps,
            "best": best, "host_best": host, "paths": rows}


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f} ms"


def _why(best: dict, host: dict) -> str:
    return (f"one gather of [kv_latent | k_pos_emb | index_key] ({best['values_per_token']:,} values "
            f"a token) serves the indexer, the attention and the loss, and its reduce-scatter is "
            f"the whole backward; the host's {host['path'].split()[-1]} path hands "
            f"{host['values_per_token']:,} values a token forward and "
            f"{host['values_per_token_backward']:,} backward to {host['collectives']} collectives")


def print_recommendation(rec: dict, fmt_bytes: Callable, width: int) -> None:
    """The recommendation block; its last line is the flags to add."""
    def say(text, indent=""):
        print(textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent + "  ",
                            break_on_hyphens=False))
    b, host = rec["best"], rec["host_best"]
    print()
    for row in rec["paths"].values():
        if "refused" in row:
            say(f"{row['path']}: n/a: {row['refused']}", "  ")
    if rec["cp_size"] == 1:
        say("recommendation: CP=1 exchanges nothing, so LAGA has nothing to save: keep the host's "
            "attention (leave --mla-latent-all-gather off).")
        return
    name = "LAGA's one gather" if b["path"] == "laga" else f"the {b['path']} path"
    say(f"recommendation ({rec['basis']}): {name}")
    if b is not host:
        dt = host["comm_s"] - b["comm_s"]
        say(f"against the host's {host['path'].split()[-1]} path (its faster one here): collectives "
            f"{_ms(b['comm_s'])} vs {_ms(host['comm_s'])} per layer fwd+bwd (saves {_ms(dt)}, "
            f"{100 * dt / host['comm_s']:.0f}%); bytes received {fmt_bytes(b['received_bytes'])} vs "
            f"{fmt_bytes(host['received_bytes'])} ({host['received_bytes'] / b['received_bytes']:.2f}x "
            f"fewer); {b['collectives']} collectives instead of {host['collectives']}", "  ")
        say(f"why: {_why(b, host)}; the compute (the same picks and sparse attention on "
            "every path) is left out of the times", "  ")
    say(f"flags: {b['flags']}", "  ")

"""``plan``'s tables and notes as text, every line within a 100-column terminal."""
from __future__ import annotations

import textwrap
from typing import Dict, List

from ...cp_algos import takes_ulysses_degree
from .output import GiB, MiB, fmt_bytes as _fmt_bytes, ratio as _ratio
from . import recommend

WIDTH = 100  # every line of the tables fits a 100-column terminal


def _say(text: str, indent: str = "") -> None:
    """A note wrapped to the tables' width."""
    print(textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  "))


def print_plan(plan: dict) -> None:
    c = plan["config"]
    _say(f"plan: n={c['heads']} d_n={c['qk_head_dim']} d_r={c['qk_pos_emb_head_dim']} "
         f"d_v={c['v_head_dim']} d_c={c['kv_lora_rank']}, S={c['seq_len']}, b={c['micro_batch']}, "
         f"CP={c['cp_size']}, TP={c['tp_size']}, {c['dtype']}; per layer and per CP rank (model)")
    if plan.get("preset"):
        _say(f"dims: preset {plan['preset']}{' and the dim flags' if plan.get('dims_flagged') else ''}")
    if plan.get("cp_defaulted") and "nodes" in plan:
        per_node = plan["nodes"]["cluster"]["devices_per_node"]
        _say(f"CP={c['cp_size']}: the default with the node table, two nodes of {per_node}, so "
             "traffic crosses the inter-node link (where hybrid CP gains); --cp sets it")
    if c.get("doc_lens"):
        lens = c["doc_lens"]
        shown = ",".join(map(str, lens)) if len(lens) <= 8 else f"{len(lens)} documents"
        print(f"documents: {shown} (a query sees only its own document)")
    recommend.print_recommendation(plan["recommendation_rows"], _fmt_bytes, WIDTH)  # the answer first
    print("\nthe tables behind it:")
    for algo, entry in plan["algos"].items():
        hybrid = f", U={entry['ulysses_degree']}" if takes_ulysses_degree(algo) else ""
        print(f"\ncp_algo={algo} (layout {entry['layout']}{hybrid})")
        _print_comm_flops(entry, algo)
        _print_memory(entry, algo)
        kernels = list(entry["kernels"])
        _print_notes(entry["notes"], kernels[-1])
        if plan.get("show_terms"):
            _print_terms(entry["kernels"][kernels[-1]], kernels[-1])
        if "fit" in entry:
            _print_fit(entry["fit"])
    _print_times(plan["time"])
    if "nodes" in plan:
        _print_nodes(plan["nodes"])
    print()
    _say("saved: activation bytes autograd keeps inside the attention call, worst CP rank "
         "(kv_up_weight excluded); peak: predicted peak memory of the call above its inputs (saved + "
         "output + the largest transient: kernel workspace, backward buffers or the blockwise "
         "block and accumulators; an estimate, `--terms` names them); FLOPs: the last kernel's, "
         "attention as executed (masked keys of each segment's key window included), worst rank "
         "unless 'rank avg'; `--json` has every term, rank averages included.")
    sampled = _ranks_costed(plan)
    if sampled < c["cp_size"]:
        _say(f"CP={c['cp_size']}: the per-rank figures come from {sampled} of the {c['cp_size']} ranks "
             "(the first and last 8, where the causal split's extremes lie, and 16 evenly spaced, "
             "whose mean is the rank average)")


def _ranks_costed(plan: dict) -> int:
    return min(r["ranks_costed"] for entry in plan["algos"].values()
               for rows in entry["kernels"].values() for r in rows.values())


def _trimmed_of(name: str) -> str:
    """The variant a '+trim' variant trims ('laga+blockwise+trim' -> 'laga+blockwise')."""
    return name.replace("+trim", "")


def _print_rows(cells: Dict[str, str], algo: str) -> None:
    """One line per variant; a '+trim' variant equal to its untrimmed twin in every cell
    says so instead of repeating the figures."""
    for name, line in cells.items():
        base = _trimmed_of(name)
        if name != base and cells.get(base) == line:
            why = "every rank sees every key" if algo == "ulysses" else "its worst rank sees every key"
            print(f"{name:<20} = {base} in every column ({why})")
        else:
            print(f"{name:<20} {line}")


def _print_comm_flops(entry: dict, algo: str) -> None:
    kernels = list(entry["kernels"])
    rows = entry["kernels"][kernels[0]]
    ex = rows["explicit"]
    print(f"{'bytes and FLOPs':<20} {'comm fwd+bwd':>12} {'explicit/':>9} {'wire fwd+bwd':>12} "
          f"{'explicit/':>9} {'attn TFLOP':>10} {'rebuild':>10} {'rebuild':>10}")
    print(f"{'':<20} {'(design)':>12} {'form':>9} {'(sent)':>12} {'form':>9} {'fwd+bwd':>10} "
          f"{'TFLOP':>10} {'rank avg':>10}")
    print("-" * 98)
    ex_comm = ex["comm"]["forward"]["design"] + ex["comm"]["backward"]["design"]
    ex_wire = ex["comm"]["forward"]["wire"] + ex["comm"]["backward"]["wire"]
    cells = {}
    for name, r in rows.items():
        comm = r["comm"]["forward"]["design"] + r["comm"]["backward"]["design"]
        wire = r["comm"]["forward"]["wire"] + r["comm"]["backward"]["wire"]
        f = entry["kernels"][kernels[-1]][name]["flops"]
        attn = (f["attention_fwd"]["worst"] + f["attention_bwd"]["worst"]) / 1e12
        reb = (f["rebuild_fwd"]["worst"] + f["rebuild_bwd"]["worst"]) / 1e12
        avg = (f["rebuild_fwd"]["average"] + f["rebuild_bwd"]["average"]) / 1e12
        cells[name] = (f"{_fmt_bytes(comm):>12} {_ratio(ex_comm, comm):>9} {_fmt_bytes(wire):>12} "
                       f"{_ratio(ex_wire, wire):>9} {attn:>10.3f} {reb:>10.3f} {avg:>10.3f}")
    _print_rows(cells, algo)


MEMORY_COLUMNS = 36  # one kernel's saved, form/expl and peak columns in the memory table


def _print_memory(entry: dict, algo: str) -> None:
    """Per kernel its own memory columns, headed by its name (kernels with the same figures
    too: none is folded into another's column), as many kernels a block as fit WIDTH (any
    number of registered kernels stays within the terminal)."""
    shown = list(entry["kernels"])
    per_block = max(1, (WIDTH - 20) // MEMORY_COLUMNS)
    for start in range(0, len(shown), per_block):
        _print_memory_block(entry, algo, shown[start:start + per_block])


def _print_memory_block(entry: dict, algo: str, kernels: List[str]) -> None:
    print()
    if all(len(k) <= 6 for k in kernels):  # "saved <kernel>" fits a cell
        print(f"{'memory':<20}" + "".join(f" {'saved ' + k:>12} {'form/expl':>9} {'peak ' + k:>12}"
                                          for k in kernels))
    else:  # a row of kernel names over their columns
        print(f"{'memory':<20}" + "".join(f" {k[:MEMORY_COLUMNS - 1]:^{MEMORY_COLUMNS - 1}}"
                                          for k in kernels))
        print(f"{'':<20}" + "".join(f" {'saved':>12} {'form/expl':>9} {'peak':>12}" for _ in kernels))
    print(f"{'':<20}" + "".join(f" {'(worst rank)':>12} {'':>9} {'(worst rank)':>12}" for _ in kernels))
    print("-" * (20 + MEMORY_COLUMNS * len(kernels)))
    cells = {}
    for name in entry["kernels"][kernels[0]]:
        line = []
        for k in kernels:
            saved = entry["kernels"][k][name]["saved_bytes"]["worst"]
            base = entry["kernels"][k]["explicit"]["saved_bytes"]["worst"]
            peak = entry["kernels"][k][name]["peak_bytes"]["worst"]
            line.append(f"{_fmt_bytes(saved):>12} {_ratio(saved, base):>9} {_fmt_bytes(peak):>12}")
        cells[name] = " ".join(line)
    _print_rows(cells, algo)


def _x(value) -> str:
    return "n/a (no CP)" if value is None else f"{value:.2f}x"


def _print_notes(n: dict, kernel: str) -> None:
    _say(f"trade-offs ({kernel} kernel): comm explicit/LAGA {_x(n['comm_explicit_over_laga_design'])} "
         f"(design), {_x(n['comm_explicit_over_laga_wire'])} (wire); saved absorbed/explicit "
         f"{n['saved_absorbed_over_explicit']:.2f}x, LAGA/explicit {n['saved_laga_over_explicit']:.2f}x; "
         f"absorbed attention FLOPs {n['attention_flops_absorbed_over_explicit']:.2f}x explicit; "
         f"LAGA rebuild FLOPs {n['rebuild_flops_laga_over_explicit']:.2f}x explicit "
         f"(extra = {100 * n['extra_rebuild_over_visible_attention']:.0f}% of causal attention FLOPs)",
         "  ")
    if n["extra_rebuild_over_visible_attention"] > 0.005:
        _say("  rebuild extra: each rank rebuilds K/V for every gathered key where explicit rebuilds "
             "only its own 1/CP and gathers the rest; it is set against the attention FLOPs of the "
             "pairs a query sees, which documents cut (a query sees only its own document: about "
             "1/N of the causal sequence's with N equal documents) while the rebuild stays, so the "
             "share grows with the number of documents; laga+trim rebuilds only the keys a rank's "
             "queries see", "  ")
    if "rebuild_flops_laga_trim_over_explicit_average" in n:
        _say(f"prefix trimming: rebuild {n['rebuild_flops_laga_trim_over_explicit_average']:.2f}x "
             f"explicit on the rank average, {n['rebuild_flops_laga_trim_over_explicit_worst']:.2f}x "
             "on the worst rank", "  ")
    for name in ("laga+blockwise", "laga+recompute"):
        if f"saved_{name}_over_explicit" in n:
            _say(f"{name}: saved {n[f'saved_{name}_over_explicit']:.2f}x explicit, "
                 f"{n[f'saved_{name}_over_absorbed']:.2f}x absorbed; rebuild FLOPs (fwd+bwd) "
                 f"{n[f'rebuild_flops_fwd_bwd_{name}_over_laga']:.2f}x LAGA's", "  ")


def _print_terms(rows: Dict[str, dict], kernel: str) -> None:
    print(f"  saved tensors, rank 0, {kernel} kernel (MiB):")
    for name, r in rows.items():
        cells = "; ".join(f"{t['name']} {t['bytes'] / MiB:.1f}" for t in r["saved_terms_rank0"])
        _say(f"{name}: {cells}", "    ")
    print(f"  peak terms, rank 0, {kernel} kernel (MiB):")
    for name, r in rows.items():
        cells = " + ".join(f"{t['name']} {t['bytes'] / MiB:.1f}" for t in r["peak_terms_rank0"])
        _say(f"{name}: {cells}", "    ")


def _print_fit(fit: dict) -> None:
    for kernel, rows in fit.items():
        cells = ", ".join(f"{name} {'fits' if r['fits'] else 'DOES NOT FIT'} ({100 * r['fraction']:.0f}%)"
                          for name, r in rows.items())
        _say(f"fit ({kernel}): {cells}", "  ")


def _print_times(times: dict) -> None:
    for name, m in times.items():
        print()
        _say(f"estimated per-layer fwd+bwd time in ms, {name} (link {m['link_gbps']:g} GB/s per rank, "
             f"{m['tflops']:g} TFLOPS effective, sdpa kernel, worst rank; serial compute + comm, "
             "minus what the overlapped latent gather hides behind the query projection):")
        algos = list(m["rows"])
        label = {a: f"hybrid U={m.get('ulysses_degree')}" if takes_ulysses_degree(a) else a for a in algos}
        timed = [a for a in algos if "error" not in m["rows"][a]]
        variants = list(dict.fromkeys(v for a in timed for v in m["rows"][a]))
        per_block = max(1, (WIDTH - 22) // 13)  # as many algorithm columns as fit WIDTH
        for start in range(0, len(timed), per_block):
            block = timed[start:start + per_block]
            print(f"  {'variant':<20}" + "".join(f" {label[a]:>12}" for a in block))
            for v in variants:
                print(f"  {v:<20}" + "".join(f" {1e3 * m['rows'][a][v]['total_s']:>12.2f}"
                                             for a in block))
        for a in algos:
            if a not in timed:
                _say(f"{label[a]}: n/a: {m['rows'][a]['error']}", "  ")


def _algo_label(r: dict) -> str:
    return f"hybrid U={r['ulysses_degree']}" if takes_ulysses_degree(r["cp_algo"]) else r["cp_algo"]


def _print_nodes(nodes: dict) -> None:
    c = nodes["cluster"]
    print()
    _say(f"estimated per-layer fwd+bwd time on nodes of {c['devices_per_node']} devices ({c['name']}: "
         f"intra-node {c['intra_gbps']:g} GB/s, inter-node {c['inter_gbps']:g} GB/s per rank, "
         f"{c['tflops']:g} TFLOPS effective; sdpa kernel, worst rank; a group inside a node runs at the "
         "intra-node link, an all-to-all across nodes sends to its node's peers intra-node and to the "
         "rest inter-node, a gather across nodes runs at the inter-node link):")
    head = (f"  {'cp_algo':<14} {'variant':<20} {'ms':>9} {'compute':>9} {'comm':>8} "
            f"{'intra GiB':>10} {'inter GiB':>10}")
    print(head)
    print("  " + "-" * (len(head) - 2))
    for r in nodes["rows"]:
        if "error" in r:
            _say(f"{_algo_label(r):<14} n/a: {r['error']}", "  ")
            continue
        print(f"  {_algo_label(r):<14} {r['variant']:<20} {1e3 * r['total_s']:>9.2f} "
              f"{1e3 * r['compute_s']:>9.2f} {1e3 * (r['comm_s'] - r['hidden_s']):>8.2f} "
              f"{r['intra_bytes'] / GiB:>10.3f} {r['inter_bytes'] / GiB:>10.3f}")
    spanning = sorted({r["ulysses_degree"] for r in nodes["rows"] if r.get("ulysses_spans_nodes")})
    for u in spanning:
        _say(f"note: U={u} does not fit in a node of {c['devices_per_node']} devices: its all-to-alls "
             "cross nodes (inter-node link for the remote peers)", "  ")
    timed = [r for r in nodes["rows"] if "error" not in r]
    if timed and not any(r["inter_bytes"] for r in timed):
        _say(f"note: every CP rank shares one node of {c['devices_per_node']}: nothing crosses the "
             "inter-node link, where hybrid CP gains; a --cp over two nodes shows it", "  ")

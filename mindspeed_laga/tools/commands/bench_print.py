"""``bench``'s table and notes as text: the columns, the overlap and hidden-share lines,
the peak note and the blockwise path's trend against the number of documents."""
from __future__ import annotations

import sys
from typing import Dict, List, Optional

from .bench_rows import _group
from .output import pad as _pad
from .timing import speed_text, timing_conclusive

# The table: (header, JSON key, format). Every cell is a key of the row's JSON.
COLUMNS = (
    ("variant", "variant", "{:<20}"),
    ("fwd bytes", "comm_forward_bytes", "{:>10,}"),
    ("bwd bytes", "comm_backward_bytes", "{:>10,}"),
    ("wire bytes", "comm_wire_bytes", "{:>11,}"),
    ("expl/form", "comm_explicit_over_form", "{:>9}"),
    ("saved KiB", "saved_kib", "{:>10.1f}"),
    ("model KiB", "model_saved_kib", "{:>10.1f}"),
    ("meas/model", "saved_measured_over_model", "{:>10}"),
    ("form/expl", "saved_form_over_explicit", "{:>9}"),
    ("attn GFLOP", "model_attention_gflop", "{:>10.4f}"),
    ("peak MiB", "peak_mib", "{:>8}"),
    ("model peak", "model_peak_mib", "{:>10.2f}"),
    ("ms", "ms", "{:>8.2f}"),
    ("max rel err", "max_rel_err", "{:>11.2e}"),
)


def print_table(rows: List[dict], out=None) -> None:
    out = out or sys.stdout
    header = " ".join(_pad(h, fmt) for h, _, fmt in COLUMNS)
    current = None
    for r in rows:
        if _group(r) != current:
            current = _group(r)
            docs = f" documents={r['documents']}" if r["cu_seqlens"] else ""
            hybrid = f" U={r['ulysses_degree']}" if "ulysses_degree" in r else ""
            print(f"\nS={r['seq_len']} cp_algo={r['cp_algo']}{hybrid} layout={r['layout']}{docs}",
                  file=out)
            print(header, file=out)
            print("-" * len(header), file=out)
        print(" ".join(fmt.format(r[key]) for _, key, fmt in COLUMNS), file=out)
        if "comm_wire_by_group" in r:
            got, model = r["comm_wire_by_group"], r["model_comm_wire_by_group"]
            print("  wire by group (measured / model): " + ", ".join(
                f"{g} {got.get(g, 0):,} / {model.get(g, 0):,.0f}" for g in GROUPS), file=out)
        if "latent_comm_hidden_share" in r:
            base = next(x for x in rows if _group(x) == _group(r) and x["variant"] == "laga+qproj")
            print(overlap_text(base, r), file=out)
    if any("comm_wire_by_group" in r for r in rows):
        degree = next(r["ulysses_degree"] for r in rows if "ulysses_degree" in r)
        print(f"\ngroups: ulysses = the {degree} ranks that split heads (one node); ring = the ranks "
              "with the same Ulysses rank (explicit gathers K/V here, across nodes); cp = every "
              "rank (the latent forms gather the latent here)", file=out)


def overlap_text(base: dict, ov: dict) -> str:
    """The overlap line: a speedup where the timing is conclusive, else why it is not."""
    if not ov.get("overlap_conclusive"):
        spread = " and ".join(f"{r['variant']} {r['ms']:.2f} ms (runs {r.get('ms_min', r['ms']):.2f}-"
                              f"{r.get('ms_max', r['ms']):.2f})" for r in (base, ov))
        return (f"  overlap: timing inconclusive on this machine: {spread}; the runs spread more "
                "than the difference (or fewer than 2 timed runs); rerun with more --repeat, longer "
                "--seq-lens or on an idle machine")
    b = ov["latent_blocked_ms"]
    return (f"  overlap: fwd+bwd {speed_text(ov['overlap_speedup'])} against laga+qproj (same "
            "work, gather not overlapped); latent gather + "
            f"reduce-scatter blocked {b['without_overlap']:.2f} ms -> {b['with_overlap']:.2f} ms "
            f"({hidden_share_text(ov['latent_comm_hidden_share'])})")


# Hybrid CP's groups, in the order the tables list them (every row names all three).
GROUPS = ("ulysses", "ring", "cp")


def hidden_share_text(share: float) -> str:
    """The overlap's hidden share; below zero the overlapped run blocked longer, which is
    timing noise (the overlap adds no communication), not a negative amount hidden."""
    if share >= 0:
        return f"{100 * share:.0f}% hidden"
    return (f"none hidden: {100 * share:.0f}% is timing noise, the overlapped run blocked "
            "longer; rerun with more --repeat or longer --seq-lens")


def peak_note(device_type: str, unmeasured: Optional[str] = None) -> str:
    """What the two peak columns are, and whether this machine checks the model's
    (``unmeasured``: why the measured peak is n/a, if it is)."""
    what = ("model peak: the cost model's prediction in MiB for the rank it expects highest "
            "(saved + output + the largest transient, costmodel/peak.py)")
    if unmeasured:
        return f"peak: n/a ({unmeasured}); {what}, unchecked on this machine."
    if device_type == "cpu":
        return ("peak: the CPU allocator's peak above the inputs, from the torch profiler's "
                "memory events in one extra untimed fwd+bwd per variant (worst rank); "
                f"{what}.")
    return (f"peak: max_memory_allocated above the inputs after reset_peak_memory_stats "
            f"({device_type}, worst rank); {what}.")


def print_document_trend(rows: List[dict], out=None) -> None:
    """The blockwise path's attention FLOPs and time against the number of documents."""
    out = out or sys.stdout
    trends: Dict[tuple, List[dict]] = {}
    for r in rows:
        if r["variant"] == "laga+blockwise":
            trends.setdefault((r["seq_len"], r["cp_algo"]), []).append(r)
    for (seq_len, algo), rs in trends.items():
        if len(rs) < 2:
            continue
        first = rs[0]
        cells = ", ".join(f"{r['documents']} docs {r['model_attention_gflop']:.4f} GFLOP "
                          f"({r['model_attention_flops'] / first['model_attention_flops']:.3f}x) "
                          f"{r['ms']:.2f} ms ({_time_ratio(first, r)})" for r in rs)
        print(f"\nlaga+blockwise S={seq_len} {algo}, attention vs documents: {cells}", file=out)


def _time_ratio(first: dict, r: dict) -> str:
    """r's time against the first row's, where the runs' spread does not swamp it."""
    if r is first or timing_conclusive(first, r):
        return f"{r['ms'] / first['ms']:.2f}x"
    return "ratio inconclusive: the runs spread more than the difference"

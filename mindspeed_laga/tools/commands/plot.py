"""``bench``'s plot: each variant's collective bytes, saved activations, peak memory and
time as a ratio to explicit's at the same setting.

One column of panels per cp_algo (with several document counts, per cp_algo and
sequence length), four rows: bytes (fwd+bwd), activations saved for backward,
peak memory above the inputs, fwd+bwd time. Along x the settings (sequence
lengths, or document counts), at each a bar per variant, explicit's at 1 by
definition; a panel's title gives explicit's own figure with its unit. Time
bars carry the spread of the timed runs (fastest to slowest run, each run
timed by its slowest rank), the panel scaled to the bars: a whisker past the
top is clipped there and marked with a triangle; peak bars carry the cost
model's prediction as a black tick. Every bar carries its ratio (9 pt, above the
bar and its whisker); a time ratio the runs' spread could make alone reads
"inconclusive" (``timing.timing_conclusive``). Colour
families separate the forms (explicit grey, absorbed blue, LAGA oranges and
browns, each option its own shade and hatch); one legend below the panels; the
configuration (CP, dims, dtype, kernel, U) is the figure's title. Hybrid CP's
bytes panel splits each bar into the intra-node part (the Ulysses group, solid)
and the cross-node part (ring and CP groups, hatched).
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

from .output import MiB
from .timing import timing_conclusive

KiB = 1024


class Panel(NamedTuple):
    title: str
    value: Callable[[dict], Optional[float]]          # a row's measured figure
    unit: Callable[[float], str]                      # explicit's figure, with its unit
    spread: Optional[Callable[[dict], Tuple[float, float]]] = None  # (low, high) of the figure
    model: Optional[Callable[[dict], Optional[float]]] = None       # the cost model's figure
    lower: Optional[Callable[[dict], float]] = None   # the bar's solid lower part (hybrid: intra-node)


def _bytes(n: float) -> str:
    if n >= MiB:
        return f"{n / MiB:,.2f} MiB"
    return f"{n / KiB:,.1f} KiB" if n >= KiB else f"{n:,.0f} B"


PANELS = (
    Panel("collective bytes per rank, fwd+bwd (counted)",
          lambda r: r["comm_forward_bytes"] + r["comm_backward_bytes"], _bytes),
    Panel("activations saved for backward per rank (counted)", lambda r: r["saved_bytes"], _bytes),
    Panel("peak memory above the inputs, worst rank (one run; tick: cost model)",
          lambda r: r.get("peak_bytes"), _bytes, model=lambda r: r.get("model_peak_bytes")),
    Panel("fwd+bwd time, slowest rank (median; whisker: fastest-slowest run)",
          lambda r: r["ms"], lambda ms: f"{ms:,.2f} ms",
          spread=lambda r: (r.get("ms_min", r["ms"]), r.get("ms_max", r["ms"]))),
)
# Hybrid CP: wire bytes, the Ulysses group's (inside a node) solid, the rest (across) hatched.
HYBRID_BYTES = Panel("wire bytes per rank, fwd+bwd (counted; solid: intra-node Ulysses group, "
                     "hatched: cross-node ring/CP groups)", lambda r: r["comm_wire_bytes"], _bytes,
                     lower=lambda r: r["comm_wire_by_group"].get("ulysses", 0))
# Families separate the forms: explicit (the baseline) grey, absorbed blue, LAGA and its
# options oranges and browns, each option with its own hatch as well.
FAMILY = {"explicit": ("#7f7f7f", ""), "absorbed": ("#1f77b4", ""), "laga": ("#ff7f0e", "")}
LAGA_SHADES = (("#fdae6b", "//"), ("#d94801", ".."), ("#8c2d04", "xx"), ("#f16913", "\\\\"),
               ("#fdd0a2", "--"), ("#a63603", "||"), ("#e6550d", "++"))
COLOURS = tuple(c for c, _ in FAMILY.values()) + tuple(c for c, _ in LAGA_SHADES)
BASE_FORMS = ("explicit", "absorbed", "laga")
CLIPPED = "^"  # the marker of a whisker cut at the panel's top
LABEL_PT = 9    # the ratio labels' size: readable at the figure's dpi
INCONCLUSIVE = "?"  # after a time ratio the runs' spread could make alone (the title says so)
# Room above the highest label's anchor for the label itself (upright: a rotated 9 pt ratio)
HEADROOM = {True: 1.3, False: 1.12}


def matplotlib_missing() -> bool:
    import importlib.util
    return importlib.util.find_spec("matplotlib") is None


def check_plot_path(path: Optional[str]) -> None:
    """ValueError naming --plot when matplotlib cannot write ``path``'s format (before the run)."""
    if not path or path == "-":  # "-": PNG on stdout
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        return  # the run skips the plot and says so
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    supported = Figure().canvas.get_supported_filetypes()
    if ext and ext not in supported:
        raise ValueError(f"--plot {path!r}: matplotlib writes {sorted(supported)}, not {ext!r}; "
                         "name the file .png (or another of those)")


def styles(rows: List[dict]) -> Dict[str, Tuple[str, str]]:
    """(colour, hatch) per variant: the three forms always the same, LAGA's options in the
    LAGA family after them."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    ordered = [v for v in BASE_FORMS if v in variants] + [v for v in variants if v not in BASE_FORMS]
    extra = iter(LAGA_SHADES * 2)
    return {v: FAMILY.get(v) or next(extra) for v in ordered}


def colours(rows: List[dict]) -> Dict[str, str]:
    """A colour per variant (see :func:`styles`)."""
    return {v: c for v, (c, _) in styles(rows).items()}


def _columns(rows: List[dict]) -> Tuple[List[tuple], str]:
    """The panel columns ((cp_algo, seq_len or None), ...) and the x axis's key."""
    algos = list(dict.fromkeys(r["cp_algo"] for r in rows))
    if len({r.get("documents", 1) for r in rows}) > 1:
        lens = sorted({r["seq_len"] for r in rows})
        return [(a, s) for a in algos for s in lens], "documents"
    return [(a, None) for a in algos], "seq_len"


def write_plot(rows: List[dict], path: str, title: Optional[str] = None) -> Optional[str]:
    """The figure at ``path``; None if matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = build_figure(rows, title)
    target = sys.stdout.buffer if path == "-" else path  # "-": the PNG on stdout
    fig.savefig(target, dpi=110, bbox_inches="tight", format="png" if path == "-" else None)
    if path == "-":
        sys.stdout.buffer.flush()
    plt.close(fig)
    return path


def build_figure(rows: List[dict], title: Optional[str] = None):
    """The matplotlib figure of ``rows`` (matplotlib must be installed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    columns, x_key = _columns(rows)
    palette = styles(rows)
    variants = list(palette)
    panels = ((HYBRID_BYTES,) + PANELS[1:]) if any("comm_wire_by_group" in r for r in rows) else PANELS
    xs = sorted({r.get(x_key, 1) for r in rows})
    width = max(7.0, 1.2 + 0.3 * len(variants) * len(xs))
    fig, axes = plt.subplots(len(panels), len(columns), figsize=(width * len(columns), 3.4 * len(panels)),
                             squeeze=False, layout="constrained")
    for col, (algo, seq_len) in enumerate(columns):
        mine = [r for r in rows if r["cp_algo"] == algo and seq_len in (None, r["seq_len"])]
        where = algo if seq_len is None else f"{algo}, S={seq_len}"
        for row, panel in enumerate(panels):
            _draw(axes[row][col], mine, x_key, panel, palette, where)
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=palette[v][0], hatch=palette[v][1],
                             edgecolor="black", linewidth=0.3) for v in variants]
    labels = list(variants)
    if any(r.get("model_peak_bytes") for r in rows):
        handles.append(plt.Line2D([], [], color="black", marker="_", linestyle="", markersize=14,
                                  markeredgewidth=2))
        labels.append("cost model's peak")
    ncol = max(1, min(len(labels), int(width * len(columns) // 1.9)))
    fig.legend(handles, labels, loc="outside lower center", ncol=ncol, fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def _groups(rows: List[dict], x_key: str) -> Dict[float, Dict[str, dict]]:
    out: Dict[float, Dict[str, dict]] = {}
    for r in rows:
        out.setdefault(r.get(x_key, 1), {})[r["variant"]] = r
    return dict(sorted(out.items()))


def _draw(ax, rows: List[dict], x_key: str, panel: Panel, palette: Dict[str, tuple], where: str) -> None:
    groups = _groups(rows, x_key)
    variants = [v for v in palette if any(v in g for g in groups.values())]
    bar = 0.8 / max(len(variants), 1)
    ratios, whiskers, labels = [], [], []
    inconclusive = 0
    many = len(groups) * len(variants) > 8  # narrow bars: labels turn upright
    for i, (x, group) in enumerate(groups.items()):
        base = group.get("explicit")
        ex = panel.value(base) if base else None
        for j, v in enumerate(variants):
            r = group.get(v)
            got = panel.value(r) if r else None
            if not ex or got is None:
                continue
            pos = i - 0.4 + bar * (j + 0.5)
            ratio = got / ex
            colour, hatch = palette[v]
            if panel.lower:  # the solid lower part, the rest hatched
                low = panel.lower(r) / ex
                ax.bar(pos, low, bar, color=colour, edgecolor="black", linewidth=0.3)
                bars = ax.bar(pos, ratio - low, bar, bottom=low, color=colour, hatch="///",
                              edgecolor="black", linewidth=0.3, label=v)
            else:
                bars = ax.bar(pos, ratio, bar, color=colour, hatch=hatch, edgecolor="black",
                              linewidth=0.3, label=v)
            ratios.append(ratio)
            text, above = f"{ratio:.2f}x", ratio
            if panel.spread:
                lo, hi = panel.spread(r)
                ex_lo, ex_hi = panel.spread(base)
                # the ratio's range over every pairing of a run of each
                whiskers.append((pos, lo / ex_hi, hi / ex_lo))
                above = max(ratio, hi / ex_lo)
                if r is not base and not timing_conclusive(base, r):
                    text += INCONCLUSIVE
                    inconclusive += 1
            labels.append((pos, above, text))
            model_ex = panel.model(base) if panel.model else None
            model = panel.model(r) if panel.model else None
            if model and model_ex:
                ax.plot([pos], [model / model_ex], marker="_", color="black", markersize=max(4, 60 * bar),
                        markeredgewidth=2, linestyle="")
                ratios.append(model / model_ex)
    clipped, cut = _whiskers(ax, whiskers, ratios)
    ax.axhline(1.0, color="tab:gray", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([_setting(x, x_key) for x in groups])
    ax.set_xlim(-0.5, len(groups) - 0.5)
    ax.set_xlabel("sequence length" if x_key == "seq_len" else "documents per sequence")
    ax.set_ylabel("ratio to explicit")
    positive = [q for q in ratios if q > 0]
    if not whiskers and positive and max(positive) / min(positive) > 20:
        ax.set_yscale("log")
    _labels(ax, labels, many, cut)
    note = f"; {CLIPPED}: whisker clipped at the top" if clipped else ""
    if inconclusive:
        note += (f"\n{INCONCLUSIVE}: inconclusive, the runs spread more than the difference "
                 "to explicit")
    ax.set_title(f"{where}: {panel.title}\n{_explicit_note(groups, x_key, panel)}{note}", fontsize=9)


def _labels(ax, labels: List[tuple], upright: bool, cut: Optional[float]) -> None:
    """Each bar's ratio above the bar and its whisker (a whisker cut at ``cut``: above the
    cut); upright where the bars are narrow. A linear panel grows to hold them."""
    anchors = []
    for pos, above, text in labels:
        y = above if cut is None else min(above, cut)
        anchors.append(y)
        ax.annotate(text, (pos, y), xytext=(0, 3), textcoords="offset points", ha="center",
                    va="bottom", fontsize=LABEL_PT, rotation=90 if upright else 0)
    if anchors and ax.get_yscale() == "linear":
        ax.set_ylim(0, max(anchors + [ax.get_ylim()[1] / HEADROOM[upright]]) * HEADROOM[upright])


def _whiskers(ax, whiskers: List[tuple], ratios: List[float]) -> Tuple[int, Optional[float]]:
    """The spread whiskers with the panel scaled to the bars (not to a noisy run): a whisker
    past the top is cut there and marked; returns how many were cut and where."""
    if not whiskers:
        return 0, None
    top = 1.35 * max(ratios + [1.0])
    cut = 0
    for pos, lo, hi in whiskers:
        ax.plot([pos, pos], [max(lo, 0), min(hi, top)], color="black", linewidth=0.8)
        if hi > top:
            cut += 1
            ax.plot([pos], [top], marker=CLIPPED, color="black", markersize=5, linestyle="")
        else:
            ax.plot([pos], [hi], marker="_", color="black", markersize=4, linestyle="")
    ax.set_ylim(0, top * 1.04)
    return cut, top


def _explicit_note(groups, x_key: str, panel: Panel) -> str:
    """Explicit's own figure at the largest setting: the unit the ratios are taken of."""
    for x, group in reversed(list(groups.items())):
        base = group.get("explicit")
        value = panel.value(base) if base else None
        if value is not None:
            at = _setting(x, x_key)
            if not value:
                return f"explicit: {panel.unit(value)} at {at} (no ratios: nothing to divide by)"
            return f"explicit: {panel.unit(value)} at {at}"
    return "explicit: not measured"


def _setting(x, x_key: str) -> str:
    if x_key == "seq_len":
        return f"S={x}"
    return f"{x} doc" if x == 1 else f"{x} docs"

"""``bench``'s plot: bytes, saved activations, peak memory and time per variant.

One column of panels per cp_algo, four rows: collective bytes (fwd+bwd),
activations saved for backward, peak memory above the inputs, fwd+bwd time.
The x axis is the sequence length; with several document counts (--num-docs
1,4,...) it is the number of documents instead, one column per cp_algo and
sequence length. A variant's line style (and marker) names its form, its
colour the LAGA option, so nine variants stay apart; one legend for the figure.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

PANELS = (  # (title, unit, value of a row or None)
    ("collective bytes per rank (fwd+bwd)", "bytes",
     lambda r: r["comm_forward_bytes"] + r["comm_backward_bytes"]),
    ("activations saved for backward per rank", "bytes", lambda r: r["saved_bytes"]),
    ("peak memory above the inputs (worst rank)", "bytes", lambda r: r.get("peak_bytes")),
    ("fwd+bwd time (slowest rank, median)", "ms", lambda r: r["ms"]),
)
FORM_STYLE = {"explicit": ("-", "o"), "absorbed": ("--", "s"), "laga": (":", "^")}
COLOURS = ("black", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple",
           "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def check_plot_path(path: Optional[str]) -> None:
    """ValueError naming --plot when matplotlib cannot write ``path``'s format (before the run)."""
    if not path:
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


def option_of(variant: str) -> str:
    """The LAGA option a variant adds to its form ('' for a plain form)."""
    return variant.split("+", 1)[1] if "+" in variant else ""


def _colours(rows: List[dict]) -> Dict[str, str]:
    options = list(dict.fromkeys(option_of(r["variant"]) for r in rows))
    return {o: COLOURS[i % len(COLOURS)] for i, o in enumerate(options)}


def _columns(rows: List[dict]) -> Tuple[List[tuple], str]:
    """The panel columns ((cp_algo, seq_len or None), ...) and the x axis's key."""
    algos = list(dict.fromkeys(r["cp_algo"] for r in rows))
    if len({r.get("documents", 1) for r in rows}) > 1:
        lens = sorted({r["seq_len"] for r in rows})
        return [(a, s) for a in algos for s in lens], "documents"
    return [(a, None) for a in algos], "seq_len"


def write_plot(rows: List[dict], path: str) -> Optional[str]:
    """The figure at ``path``; None if matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = build_figure(rows)
    fig.savefig(path)
    plt.close(fig)
    return path


def build_figure(rows: List[dict]):
    """The matplotlib figure of ``rows`` (matplotlib must be installed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    columns, x_key = _columns(rows)
    colours = _colours(rows)
    fig, axes = plt.subplots(len(PANELS), len(columns), figsize=(5.5 * len(columns), 14),
                             squeeze=False)
    for col, (algo, seq_len) in enumerate(columns):
        mine = [r for r in rows if r["cp_algo"] == algo and seq_len in (None, r["seq_len"])]
        for row, (title, unit, value) in enumerate(PANELS):
            ax = axes[row][col]
            _draw(ax, mine, x_key, value, colours)
            where = algo if seq_len is None else f"{algo}, S={seq_len}"
            ax.set_title(f"{where}: {title}", fontsize=9)
            ax.set_xlabel("documents per sequence" if x_key == "documents" else "sequence length")
            ax.set_ylabel(unit)
    handles = {}
    for ax in axes.flat:
        for line in ax.get_lines():
            handles.setdefault(line.get_label(), line)
    fig.legend(list(handles.values()), list(handles), loc="lower center",
               ncol=min(len(handles), 5), fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def _draw(ax, rows: List[dict], x_key: str, value, colours: Dict[str, str]) -> None:
    for variant in dict.fromkeys(r["variant"] for r in rows):
        pts = sorted((r[x_key] if x_key == "seq_len" else r.get("documents", 1), value(r))
                     for r in rows if r["variant"] == variant and value(r) is not None)
        if not pts:
            continue
        form = next(r["form"] for r in rows if r["variant"] == variant)
        style, marker = FORM_STYLE.get(form, ("-.", "x"))
        ax.plot([x for x, _ in pts], [y for _, y in pts], linestyle=style, marker=marker,
                color=colours[option_of(variant)], label=variant, linewidth=1.4, markersize=5)
    ax.set_xscale("log", base=2)
    ys = [y for line in ax.get_lines() for y in line.get_ydata()]
    if ys and all(y > 0 for y in ys):
        ax.set_yscale("log")  # no CP: zero bytes would break a log axis

"""``bench``'s PNG: collective bytes and saved activations vs sequence length."""
from __future__ import annotations

from typing import List, Optional


def write_plot(rows: List[dict], path: str) -> Optional[str]:
    """Bytes and saved activations vs sequence length, one line per variant; None if no matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    algos = sorted({r["cp_algo"] for r in rows})
    fig, axes = plt.subplots(2, len(algos), figsize=(6 * len(algos), 8), squeeze=False)
    for col, algo in enumerate(algos):
        names = list(dict.fromkeys((r["variant"], r.get("documents", 1)) for r in rows
                                   if r["cp_algo"] == algo))
        several = len({docs for _, docs in names}) > 1
        for variant, docs in names:
            name = f"{variant} ({docs} docs)" if several else variant
            pts = sorted(((r["seq_len"], r) for r in rows if r["cp_algo"] == algo
                          and r["variant"] == variant and r.get("documents", 1) == docs),
                         key=lambda p: p[0])
            xs = [x for x, _ in pts]
            axes[0][col].plot(xs, [r["comm_forward_bytes"] + r["comm_backward_bytes"] for _, r in pts],
                              marker="o", label=name)
            axes[1][col].plot(xs, [r["saved_bytes"] for _, r in pts], marker="o", label=name)
        axes[0][col].set_title(f"{algo}: collective bytes per rank (fwd+bwd)")
        axes[1][col].set_title(f"{algo}: activations saved for backward per rank")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xlabel("sequence length")
            ax.set_ylabel("bytes")
            ax.set_xscale("log", base=2)
            if all(y > 0 for line in ax.get_lines() for y in line.get_ydata()):
                ax.set_yscale("log")  # no CP: zero bytes would break a log axis
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

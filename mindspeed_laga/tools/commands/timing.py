"""Whether two measured times differ by more than their noise, and how to say it: bench's
table, its overlap line and its plot read them alike."""
from __future__ import annotations


def timing_conclusive(a: dict, b: dict) -> bool:
    """Whether the difference of two rows' median times says anything on this machine: each
    has at least two timed runs and the runs of each spread (slowest - fastest) less than the
    difference of the medians. Otherwise the noise alone could make it. bench runs the
    variants' repeats in rounds, so a load that drifts shows in every row's spread."""
    spread = max(r.get("ms_max", r["ms"]) - r.get("ms_min", r["ms"]) for r in (a, b))
    runs = min(r.get("timed_runs", 1) for r in (a, b))
    return runs >= 2 and spread < abs(a["ms"] - b["ms"])


def speed_text(speedup: float) -> str:
    """``old / new`` time in words: a speedup above 1, a slowdown (``new / old``) below."""
    if speedup >= 1:
        return f"speedup {speedup:.2f}x"
    return f"slowdown {1 / speedup:.2f}x (slower)"

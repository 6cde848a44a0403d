"""bench's noise: the variants' repeats run in rounds (a drifting load shows in every
variant's spread), a slower run is called a slowdown, and the plot says which time ratios
the noise could make alone, in labels a reader can read, clear of the whiskers."""
from __future__ import annotations

import pytest

from mindspeed_laga.tools import measure
from mindspeed_laga.tools.commands import bench
from mindspeed_laga.tools.commands.timing import speed_text


def test_the_variants_run_in_rounds_and_keep_every_timed_run():
    calls = []

    def run_one(case, flops, peak):
        calls.append((case, flops, peak))
        return {"seconds_runs": [float(len(calls))], "case": case}
    out = measure.interleaved(["a", "b"], run_one, repeat=2, warmup=1, count_flops=True, cpu_peak=True)
    assert [c for c, _, _ in calls] == ["a", "b", "a", "b", "a", "b"]
    # FLOPs and the CPU peak once per case, in the last round
    assert [(f, p) for _, f, p in calls] == [(False, False)] * 4 + [(True, True)] * 2
    # the warm-up round's runs (1, 2) are dropped; a's timed runs are calls 3 and 5
    assert out[0]["seconds_runs"] == [3.0, 5.0] and out[0]["seconds"] == 4.0
    assert out[1]["seconds_runs"] == [4.0, 6.0]


def test_a_slower_run_is_a_slowdown():
    assert speed_text(2.0) == "speedup 2.00x"
    assert speed_text(0.64) == "slowdown 1.56x (slower)"
    base = {"variant": "laga+qproj", "ms": 24.0, "ms_min": 23.9, "ms_max": 24.1, "timed_runs": 3}
    ov = {"variant": "laga+overlap", "ms": 37.5, "ms_min": 37.4, "ms_max": 37.6, "timed_runs": 3,
          "overlap_speedup": 24.0 / 37.5, "overlap_conclusive": True,
          "latent_blocked_ms": {"without_overlap": 2.0, "with_overlap": 1.0},
          "latent_comm_hidden_share": 0.5}
    text = bench.overlap_text(base, ov)
    assert "slowdown 1.56x" in text and "speedup" not in text


def _row(variant, ms, lo, hi):
    return {"variant": variant, "form": variant.split("+")[0], "cp_algo": "allgather", "seq_len": 64,
            "documents": 1, "comm_forward_bytes": 64, "comm_backward_bytes": 16, "saved_bytes": 640,
            "peak_bytes": 6400, "model_peak_bytes": 5000, "ms": ms, "ms_min": lo, "ms_max": hi,
            "timed_runs": 3}


def test_the_plot_marks_inconclusive_ratios_in_readable_labels_above_the_whiskers():
    pytest.importorskip("matplotlib")
    from mindspeed_laga.tools.commands import plot
    rows = [_row("explicit", 10.0, 9.9, 10.1),
            _row("laga", 5.0, 4.9, 5.1),              # twice as fast, runs tight: conclusive
            _row("laga+trim", 9.0, 3.0, 30.0)]        # runs spread past the difference
    fig = plot.build_figure(rows)
    time_ax = fig.axes[-1]
    labels = {t.get_text(): t for t in time_ax.texts}
    assert set(labels) == {"1.00x", "0.50x", "0.90x?"}
    assert "?: inconclusive" in time_ax.get_title()
    for ax in fig.axes:
        assert all(t.get_fontsize() >= 9 for t in ax.texts)
    # every label sits at or above its whisker's top (or the panel's cut, where clipped)
    whiskers = {round(ln.get_xdata()[0], 6): max(ln.get_ydata()) for ln in time_ax.get_lines()
                if len(ln.get_xdata()) == 2 and ln.get_xdata()[0] == ln.get_xdata()[1]}
    for text in labels.values():
        x, y = text.xy
        assert y >= whiskers[round(x, 6)] - 1e-9, text.get_text()
    assert time_ax.get_ylim()[1] > max(t.xy[1] for t in labels.values())

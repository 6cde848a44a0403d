"""``mindspeed-laga bench`` on 2 gloo ranks at a tiny shape: table, JSON, plot, errors."""
import contextlib
import io
import json
import subprocess
import sys

import pytest

from mindspeed_laga.tools import cli
from mindspeed_laga.tools.commands import bench, plot as plot_module
from mindspeed_laga.vocab.names import CP_ALGOS
from support.cli_runs import assert_one_line_error, run_cli

TINY = ["--cp", "2", "--seq-lens", "16,32", "--heads", "4", "--qk-head-dim", "8",
        "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--kv-lora-rank", "16",
        "--repeat", "1", "--warmup", "0"]


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
    """One bench run for the module (it spawns the ranks); its stdout captured."""
    path = tmp_path_factory.mktemp("bench")
    out = io.StringIO()
    # without matplotlib an asked-for plot is refused; the default one is skipped with a note
    plot = [] if plot_module.matplotlib_missing() else ["--plot", str(path / "b.png")]
    with contextlib.redirect_stdout(out):
        code = cli.main(["bench", *TINY, "--json", str(path / "b.json"), *plot])
    return code, out.getvalue(), json.loads((path / "b.json").read_text()), path


def test_bench_runs_and_json_carries_every_table_figure(tiny_bench):
    code, out, doc, _ = tiny_bench
    assert code == 0
    rows = doc["rows"]
    assert {r["seq_len"] for r in rows} == {16, 32} and {r["cp_algo"] for r in rows} == set(CP_ALGOS)
    assert {"explicit", "absorbed", "laga"} <= {r["variant"] for r in rows}
    lines = out.splitlines()
    for r in rows:
        cells = [fmt.format(r[key]) for _, key, fmt in bench.COLUMNS]  # KeyError = missing in JSON
        assert " ".join(cells) in lines, cells


def test_bench_measurements_match_model_and_reference(tiny_bench):
    _, _, doc, _ = tiny_bench
    for r in doc["rows"]:
        assert r["comm_forward_bytes"] == r["model_comm_forward_bytes"], r["variant"]
        assert r["comm_backward_bytes"] == r["model_comm_backward_bytes"], r["variant"]
        assert r["comm_wire_bytes"] == r["model_comm_wire_bytes"], r["variant"]
        assert abs(r["saved_bytes"] - r["model_saved_bytes"]) <= 0.05 * r["saved_bytes"], r["variant"]
        assert r["max_rel_err"] < 1e-5, (r["variant"], r["max_rel_err"])
        assert r["ms"] > 0 and r["peak_bytes"] > 0  # CPU: the allocator's peak (test_cpu_peak.py)


def test_bench_plot_written_or_skipped_with_a_note(tiny_bench):
    _, out, _, path = tiny_bench
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert out.splitlines()[1].startswith("plot: none (matplotlib is not installed")
        assert not (path / "b.png").exists()
    else:
        assert (path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, word", [
    (["--cp", "4", "--seq-lens", "12"], "not divisible"),
    (["--cp", "4", "--heads", "6", "--cp-algo", "ulysses", "--seq-lens", "16"], "heads"),
    (["--seq-lens", "-8"], "positive"),
    (["--seq-lens", "a,b"], "integers"),
    (["--cp", "0"], "must be positive"),
    (["--heads", "-2"], "must be positive"),
    (["--warmup", "-1"], "warmup"),
    (["--json", "dir-that-does-not-exist/b.json"], "--json"),
    (["--plot", "dir-that-does-not-exist/b.png"], "--plot"),
    (["--kernel", "cuda"], "invalid choice"),
    (["--kernel", "npu"], "--kernel npu runs on NPU tensors"),
    (["--plot", "/proc/x.png"], "--plot '/proc/x.png' cannot be written"),
    (["--plot", "/dev/full"], "--plot '/dev/full' cannot be written (No space left on device)"),
    (["--json", "/dev/full"], "--json '/dev/full' cannot be written"),
    (["--plot", "b.notaformat"], "--plot 'b.notaformat': matplotlib writes"),
    (["--dtype", "int4"], "'int4' is not a dtype this command runs"),
    (["--dtype", "fp16"], "use one of fp32/float32, bf16/bfloat16"),
    # a repeated setting: once ran every variant, then KeyError 'comm_explicit_over_form'
    (["--seq-lens", "32,32"], "--seq-lens '32,32' lists 32 more than once"),
    (["--seq-lens", "32", "--num-docs", "2,2"], "--num-docs '2,2' lists 2 more than once"),
    # far past the machine: once a traceback per rank after every rank had started
    (["--seq-lens", str(10 ** 12)], "needs about"),
    (["--kv-block-size", str(10 ** 21)], "--kv-block-size 1000000000000000000000 is longer than"),
])
def test_bad_input_is_one_line_error(capsys, argv, word):
    if "notaformat" in argv[-1]:
        pytest.importorskip("matplotlib")
    """Rejected before any rank starts (the bench itself would take seconds)."""
    code, out, err = run_cli(capsys, "bench", *argv)
    assert "runs (" not in out  # the line printed once the runs are built
    assert_one_line_error("bench", code, err, word)


def test_json_dash_is_pure_json_on_stdout():
    """--json -: stdout is the JSON alone (progress, tables and notes on stderr), as a
    pipe into another program needs; the wall time is a line of its own."""
    argv = [*TINY[:2], "--seq-lens", "16", *TINY[4:], "--cp-algo", "allgather", "--forms-only"]
    proc = subprocess.run([sys.executable, "-m", "mindspeed_laga.tools.cli", "bench", *argv,
                           "--json", "-", "--plot", ""], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [r["variant"] for r in doc["rows"]] == ["explicit", "absorbed", "laga"]
    assert doc["rows"][0]["ms_min"] <= doc["rows"][0]["ms"] <= doc["rows"][0]["ms_max"]
    assert "[1/3] explicit S=16 allgather" in proc.stderr and "max rel err" in proc.stderr
    lines = proc.stderr.splitlines()
    assert any(line.startswith("wall time: ") and line.endswith(" s") for line in lines)
    assert not any(line.endswith(" s.") and "peak.py)" in line for line in lines)


def test_memory_estimate_counts_the_reference_scores():
    """The estimate grows as S^2 (the float64 reference's scores): S=4096 at the CPU default
    dims needs 8 GiB of them, and a machine with less is told before anything starts."""
    from mindspeed_laga.tools.commands import bench_fit
    from mindspeed_laga.tools.commands.shapes import CPU_DEFAULT
    from dataclasses import replace
    shape = replace(CPU_DEFAULT, seq_len=4096)
    need = bench_fit.run_bytes(shape, peak_bytes=0, local_ranks=1)
    scores = 4 * 8 * 16 * 4096 * 4096  # four float64 [1, 16, S, S] tensors
    assert scores <= need < 1.05 * scores
    case = type("Run", (), {"shape": shape})()
    model = type("Model", (), {"peak_bytes": 0})()
    bench_fit.check_fits([case], [model], 1, available=need)  # fits exactly
    with pytest.raises(ValueError, match=r"S=4096 needs about 8\.[01] GiB"):
        bench_fit.check_fits([case], [model], 1, available=need - 1)


def test_bench_with_documents_runs_the_forms_with_cu_seqlens(tmp_path):
    """--num-docs 1,4: every variant with and without packed documents on 2 ranks, checked
    against a reference that attends each document alone; the blockwise path's modelled
    attention FLOPs fall with the documents, the bytes do not change; the CPU peak is
    measured beside the model's."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["bench", *TINY[:2], "--seq-lens", "32", *TINY[4:], "--cp-algo", "allgather",
                         "--num-docs", "1,4", "--json", str(tmp_path / "d.json"), "--plot", ""])
    assert code == 0
    text = out.getvalue()
    rows = json.loads((tmp_path / "d.json").read_text())["rows"]
    by = {(r["variant"], r["documents"]): r for r in rows}
    assert {d for _, d in by} == {1, 4}
    for (name, docs), r in by.items():
        assert r["max_rel_err"] < 1e-5, (name, docs, r["max_rel_err"])
        assert r["saved_bytes"] == r["model_saved_bytes"], (name, docs)
        assert r["comm_forward_bytes"] == by[(name, 1)]["comm_forward_bytes"] == r["model_comm_forward_bytes"]
        assert r["peak_bytes"] > 0 and r["model_peak_bytes"] > r["saved_bytes"]
    assert by[("laga+blockwise", 4)]["cu_seqlens"] == [0, 8, 16, 24, 32]
    flops = [by[("laga+blockwise", d)]["model_attention_flops"] for d in (1, 4)]
    assert flops[1] < 0.5 * flops[0]
    assert "laga+blockwise S=32 allgather, attention vs documents: 1 docs" in text
    assert "peak: the CPU allocator's peak above the inputs" in text


@pytest.mark.parametrize("argv, word", [
    (["--seq-lens", "32", "--doc-lens", "16,8"], "--doc-lens sum to 24, not the sequence length 32"),
    (["--seq-lens", "32", "--num-docs", "4", "--micro-batch", "2"], "--micro-batch 1"),
    (["--seq-lens", "32", "--num-docs", "3"], "--num-docs 3 does not divide"),
    (["--seq-lens", "32", "--layout", "doc_zigzag"], "--doc-lens or --num-docs"),
])
def test_bad_document_flags_are_one_line_errors(capsys, argv, word):
    code, out, err = run_cli(capsys, "bench", "--cp", "2", *argv)
    assert "runs (" not in out
    assert_one_line_error("bench", code, err, word)


def test_kernel_npu_under_torchrun_without_torch_npu_is_one_line(capsys, monkeypatch):
    """Under torchrun the rank is this process: torch_npu is checked before the group starts."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", None)
    code, out, err = run_cli(capsys, "bench", "--kernel", "npu", "--seq-lens", "16")
    assert "runs (" not in out
    assert_one_line_error("bench", code, err, "kernel='npu' needs torch_npu")


def test_seq_len_is_the_seq_lens_flag(capsys, tmp_path):
    """bench --seq-len N is --seq-lens N (the doc-lens error's advice works as written)."""
    parser = cli.build_parser()
    one = parser.parse_args(["bench", "--seq-len", "24"])
    assert one.seq_lens == "24" and not hasattr(one, "seq_len")
    code, _, err = run_cli(capsys, "bench", "--cp", "2", "--seq-lens", "32", "--doc-lens", "16,8")
    assert code == 2 and "(or set --seq-len 24)" in err
    args = parser.parse_args(["bench", *TINY[:2], "--seq-len", "24", "--doc-lens", "16,8",
                              *TINY[4:], "--cp-algo", "allgather"])
    runs, _ = bench.build_runs(args, 2, "cpu")  # what the advice leads to is accepted
    assert {case.shape.seq_len for case in runs} == {24}
    assert {case.cu_seqlens for case in runs} == {(0, 16, 24)}


def test_output_paths_are_left_as_they_were(tmp_path):
    """Proving a path writable leaves no file behind and an existing one untouched."""
    from mindspeed_laga.tools.commands.output import check_output_path
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    old.write_text("keep")
    check_output_path("--json", str(new))
    check_output_path("--json", str(old))
    assert not new.exists() and old.read_text() == "keep"


def _rows(documents=(1,), seq_lens=(16, 32), algos=("allgather",)):
    """Synthetic bench rows: every figure a distinct function of the variant and x."""
    rows = []
    for i, (variant, form) in enumerate([("explicit", "explicit"), ("absorbed", "absorbed"),
                                         ("laga", "laga"), ("laga+trim", "laga"),
                                         ("laga+recompute", "laga")]):
        for algo in algos:
            for s in seq_lens:
                for d in documents:
                    ms = 0.5 * (i + 1) * d
                    rows.append({"variant": variant, "form": form, "cp_algo": algo,
                                 "seq_len": s, "documents": d, "comm_forward_bytes": s * (i + 1),
                                 "comm_backward_bytes": 16, "saved_bytes": 10 * s * (i + 1) // d,
                                 "peak_bytes": 100 * s * (i + 1), "model_peak_bytes": 90 * s * (i + 2),
                                 "ms": ms, "ms_min": 0.8 * ms, "ms_max": 1.5 * ms})
    return rows


def _bars(ax):
    """{variant: [bar, ...]} in x order."""
    out = {}
    for container in ax.containers:
        if hasattr(container, "patches"):  # a BarContainer (its error bars are their own)
            out.setdefault(container.get_label(), []).extend(container.patches)
    return out


def test_plot_ratios_to_explicit_with_spread_model_units_and_config():
    """What a reader needs: every panel a ratio to explicit with explicit's own figure and
    unit in its title, the time's spread over the timed runs, the model's peak beside the
    measured one, the configuration as the title, a colour per variant (explicit's not
    LAGA's), and a legend inside the saved figure with one CP algorithm."""
    pytest.importorskip("matplotlib")
    from mindspeed_laga.tools.commands import plot
    fig = plot.build_figure(_rows(), title="CP=2, heads 4, float32, kernel=sdpa")
    assert fig._suptitle.get_text() == "CP=2, heads 4, float32, kernel=sdpa"
    bytes_ax, saved_ax, peak_ax, time_ax = fig.axes
    assert "collective bytes" in bytes_ax.get_title() and "explicit: 48 B at S=32" in bytes_ax.get_title()
    assert "saved" in saved_ax.get_title() and "explicit: 320 B at S=32" in saved_ax.get_title()
    assert "peak memory" in peak_ax.get_title() and "3.1 KiB at S=32" in peak_ax.get_title()
    assert "time" in time_ax.get_title() and "explicit: 0.50 ms at S=32" in time_ax.get_title()
    assert all(ax.get_ylabel() == "ratio to explicit" for ax in fig.axes)
    assert [t.get_text() for t in time_ax.get_xticklabels()] == ["S=16", "S=32"]
    # bars are ratios to explicit at the same S: bytes (s*(i+1)+16)/(s+16), time (i+1)
    bars = _bars(bytes_ax)
    assert [b.get_height() for b in bars["explicit"]] == [1.0, 1.0]
    assert [b.get_height() for b in bars["laga"]] == pytest.approx([64 / 32, 112 / 48])
    assert [b.get_height() for b in _bars(time_ax)["laga+trim"]] == [4.0, 4.0]
    assert bars["explicit"][0].get_facecolor() != bars["laga"][0].get_facecolor()
    assert len({bars[v][0].get_facecolor() for v in bars}) == 5
    # time whiskers: fastest form run / slowest explicit run .. slowest / fastest, the panel
    # scaled to the bars (1.35 x the tallest, 5.0): laga+trim's 7.5 is cut at 6.75 and marked
    trim_x = _bars(time_ax)["laga+trim"][0]
    trim_x = trim_x.get_x() + trim_x.get_width() / 2
    whisker = [ln for ln in time_ax.get_lines() if len(ln.get_xdata()) == 2
               and ln.get_xdata()[0] == pytest.approx(trim_x)][0]
    assert list(whisker.get_ydata()) == pytest.approx([4.0 * 0.8 / 1.5, 1.35 * 5.0])
    assert any(ln.get_marker() == "^" and ln.get_xdata()[0] == pytest.approx(trim_x)
               for ln in time_ax.get_lines())
    # the panel grows to hold the upright ratio labels above the whiskers' cut
    assert time_ax.get_ylim()[1] == pytest.approx(1.35 * 5.0 * 1.3)
    assert "whisker clipped at the top" in time_ax.get_title()
    # the model's peak, as a ratio to explicit's model peak, beside each measured bar
    ticks = [line.get_ydata()[0] for line in peak_ax.get_lines() if line.get_marker() == "_"]
    assert ticks == pytest.approx([1.0, 1.5, 2.0, 2.5, 3.0] * 2)
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == [
        "explicit", "absorbed", "laga", "laga+trim", "laga+recompute", "cost model's peak"]
    fig.canvas.draw()  # nothing cropped: the legend lies inside the figure
    box, page = legend.get_window_extent(), fig.bbox
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0
    # with several document counts they are the x axis, a column per sequence length
    fig = plot.build_figure(_rows(documents=(1, 4, 16), algos=("allgather", "ulysses")))
    assert len(fig.axes) == 16
    saved = [ax for ax in fig.axes if ax.get_title().startswith("ulysses, S=16: activations")][0]
    assert [t.get_text() for t in saved.get_xticklabels()] == ["1 doc", "4 docs", "16 docs"]
    assert [b.get_height() for b in _bars(saved)["laga"]] == [3.0, 3.0, 3.0]
    assert "documents" in saved.get_xlabel()


def test_plot_renders_a_png_with_a_single_length(tmp_path):
    """One sequence length: one bar per variant with its ratio printed on it, saved whole."""
    pytest.importorskip("matplotlib")
    from mindspeed_laga.tools.commands import plot
    fig = plot.build_figure(_rows(seq_lens=(64,)))
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == ["1.00x", "1.80x", "2.60x", "3.40x", "4.20x"]  # (64(i+1)+16)/80
    path = plot.write_plot(_rows(seq_lens=(64,)), str(tmp_path / "p.png"), title="t")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path


def test_a_negative_hidden_share_is_called_noise():
    """The overlap adds no communication: a run that blocked longer with it hid nothing,
    and the raw figure is shown with that word, not as '-555% hidden'."""
    assert bench.hidden_share_text(0.42) == "42% hidden"
    text = bench.hidden_share_text(-5.55)
    assert text.startswith("none hidden: -555% is timing noise") and "% hidden" not in text


def test_plot_labels_every_bar_and_separates_the_forms():
    """Several lengths: every bar still carries its ratio; the forms' colour families differ
    and LAGA's options differ from each other in colour and hatch."""
    pytest.importorskip("matplotlib")
    from mindspeed_laga.tools.commands import plot
    rows = _rows(seq_lens=(16, 32, 64, 128))
    fig = plot.build_figure(rows)
    for ax in fig.axes:
        assert len(ax.texts) == sum(len(b) for b in _bars(ax).values()) == 20
    style = plot.styles(rows)
    assert style["explicit"][0] != style["absorbed"][0] != style["laga"][0]
    options = [style[v] for v in ("laga+trim", "laga+recompute")]
    assert len(set(options)) == 2 and all(hatch for _, hatch in options)


def test_hybrid_bytes_split_intra_and_cross_node():
    pytest.importorskip("matplotlib")
    from mindspeed_laga.tools.commands import plot
    rows = _rows(seq_lens=(64,))
    for r in rows:
        r["comm_wire_bytes"] = 1000 + 100 * len(r["variant"])
        r["comm_wire_by_group"] = {"ulysses": 600, "cp": r["comm_wire_bytes"] - 600}
    fig = plot.build_figure(rows)
    ax = fig.axes[0]
    assert "intra-node" in ax.get_title() and "cross-node" in ax.get_title()
    patches = [p for c in ax.containers for p in c.patches]
    explicit = 1000 + 100 * len("explicit")
    solid = [p for p in patches if not p.get_hatch()]
    hatched = [p for p in patches if p.get_hatch()]
    assert len(solid) == len(hatched) == 5
    assert solid[0].get_height() == pytest.approx(600 / explicit)
    assert solid[0].get_height() + hatched[0].get_height() == pytest.approx(1.0)


def _timed(variant, ms, lo, hi, runs=3):
    return {"variant": variant, "ms": ms, "ms_min": lo, "ms_max": hi, "timed_runs": runs,
            "overlap_speedup": None, "latent_blocked_ms": {"without_overlap": 2.0, "with_overlap": 0.5},
            "latent_comm_hidden_share": 0.75}


@pytest.mark.parametrize("base, ov, conclusive", [
    (_timed("laga+qproj", 10.0, 9.8, 10.3), _timed("laga+overlap", 6.0, 5.9, 6.2), True),
    # injected noise: runs from 0.3x to 30x the median, as on a loaded 2-core machine
    (_timed("laga+qproj", 10.0, 3.0, 300.0), _timed("laga+overlap", 6.0, 1.8, 180.0), False),
    (_timed("laga+qproj", 10.0, 10.0, 10.0, 1), _timed("laga+overlap", 6.0, 6.0, 6.0, 1), False),
])
def test_overlap_speedup_only_where_the_noise_is_smaller(base, ov, conclusive):
    assert bench.timing_conclusive(base, ov) is conclusive
    ov["overlap_conclusive"] = conclusive
    ov["overlap_speedup"] = base["ms"] / ov["ms"]
    text = bench.overlap_text(base, ov)
    if conclusive:
        assert "speedup 1.67x" in text and "75% hidden" in text
    else:
        assert "timing inconclusive on this machine" in text and "speedup" not in text
        assert "hidden" not in text


def _trend_row(docs, ms, lo, hi):
    return {"variant": "laga+blockwise", "seq_len": 512, "cp_algo": "allgather", "documents": docs,
            "model_attention_gflop": 1.0 / docs, "model_attention_flops": 1e9 / docs,
            "ms": ms, "ms_min": lo, "ms_max": hi, "timed_runs": 3}


def test_document_trend_states_a_time_ratio_only_where_the_noise_is_smaller(capsys):
    quiet = [_trend_row(1, 10.0, 9.9, 10.2), _trend_row(4, 4.0, 3.9, 4.1)]
    bench.print_document_trend(quiet)
    assert "4.00 ms (0.40x)" in capsys.readouterr().out
    # injected noise: runs from 0.3x to 30x the median, as on a loaded 2-core machine
    noisy = [_trend_row(1, 10.0, 3.0, 300.0), _trend_row(4, 4.0, 1.2, 120.0)]
    bench.print_document_trend(noisy)
    out = capsys.readouterr().out
    assert "4.00 ms (ratio inconclusive" in out and "0.40x" not in out


def test_default_outputs_go_into_a_named_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = cli.main(["bench", *TINY[:2], "--seq-lens", "16", "--heads", "4", "--qk-head-dim", "8",
                     "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--kv-lora-rank", "16",
                     "--repeat", "1", "--warmup", "0", "--forms-only", "--cp-algo", "allgather"])
    assert code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_out"]
    assert (tmp_path / "bench_out" / "bench.json").exists()
    out = capsys.readouterr().out
    assert f"JSON: {bench.DEFAULT_JSON}" in out


def test_plot_dash_is_the_png_on_stdout(capsysbinary, tmp_path, monkeypatch):
    """``--plot -``: the PNG alone on stdout, no file named '-'."""
    if plot_module.matplotlib_missing():
        pytest.skip("matplotlib is not installed: --plot is refused without it")
    monkeypatch.chdir(tmp_path)
    plot_module.check_plot_path("-")
    assert plot_module.write_plot(_rows(), "-") == "-"
    assert capsysbinary.readouterr().out.startswith(b"\x89PNG\r\n\x1a\n")
    assert not (tmp_path / "-").exists()

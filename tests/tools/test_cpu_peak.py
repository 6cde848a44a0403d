"""Peak CPU memory from the allocator's profiler events: the context manager on
allocations whose peak is worked out by hand, ``run_on_rank(cpu_peak=True)``, and
``bench`` filling its peak column on CPU."""
import contextlib
import io
import json
import types

import pytest
import torch

from mindspeed_laga.tools import cli
from mindspeed_laga.tools.cases import Case, MLAShape
from mindspeed_laga.tools.commands.output import MiB
from mindspeed_laga.tools.cpu_peak import CpuPeak
from mindspeed_laga.tools.measure import run_on_rank
from mindspeed_laga.tools.runspec import RunSpec

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

FLOAT32 = 4  # bytes per element


def floats(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.float32)


def test_peak_of_known_allocations():
    """a, b, c live (1000 + 3000 + 500 floats), b freed, d (5000) allocated: the peak is
    a + c + d = 6500 floats, above a + b + c = 4500."""
    with CpuPeak() as peak:
        a, b, c = floats(1000), floats(3000), floats(500)
        del b
        d = floats(5000)
    assert peak.reason is None
    assert peak.bytes == (1000 + 500 + 5000) * FLOAT32
    del a, c, d


def test_peak_reached_before_a_free_and_blind_to_what_was_there_before():
    """The peak is above the level at the start: a tensor alive before it adds nothing;
    a (4000 floats) + b (2000) is the peak, c (1000) comes after a is freed."""
    before = floats(100_000)
    with CpuPeak() as peak:
        a, b = floats(4000), floats(2000)
        del a
        c = floats(1000)
    assert peak.bytes == (4000 + 2000) * FLOAT32
    del before, b, c


def test_another_profiler_running_is_a_reason_and_left_alone():
    with torch.profiler.profile(profile_memory=True) as outer:
        with CpuPeak() as peak:
            kept = floats(2500)
    assert peak.bytes is None and peak.reason == "another torch profiler is running"
    sizes = [e.nbytes() for e in outer.profiler.kineto_results.events() if e.name() == "[memory]"]
    assert 2500 * FLOAT32 in sizes  # the outer profiler kept recording
    del kept


def test_profiler_that_cannot_start_is_a_reason(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("no profiler here")
    monkeypatch.setattr(torch.profiler, "profile", refuse)
    with CpuPeak() as peak:
        ran = floats(10)
    assert ran.numel() == 10 and peak.bytes is None
    assert "did not start" in peak.reason and "no profiler here" in peak.reason


def test_profiler_without_memory_events_is_a_reason(monkeypatch):
    class NoEvents:  # a profiler whose results lack the private kineto_results
        profiler = types.SimpleNamespace()

        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False
    monkeypatch.setattr(torch.profiler, "profile", NoEvents)
    with CpuPeak() as peak:
        floats(10)
    assert peak.bytes is None and "kineto_results" in peak.reason and torch.__version__ in peak.reason


SHAPE = MLAShape(seq_len=32, batch=2, heads=4, qk_head_dim=8, rope_dim=4, v_head_dim=8, kv_lora_rank=16)


def _end_of_pass_bytes(shape: MLAShape, local_seq: int) -> int:
    """What one fwd+bwd allocates and still holds when it ends: the output and the grads
    of query, kv_latent, k_pos_emb and kv_up_weight (float32)."""
    s, b, n = local_seq, shape.batch, shape.heads
    d_n, d_r, d_v, d_c = shape.qk_head_dim, shape.rope_dim, shape.v_head_dim, shape.kv_lora_rank
    elements = (s * b * n * d_v + s * b * n * (d_n + d_r) + s * b * d_c + s * b * d_r
                + n * (d_n + d_v) * d_c)
    return elements * FLOAT32


@pytest.mark.timeout(60)
def test_run_on_rank_measures_cpu_peak_only_when_asked():
    case = Case(spec=RunSpec("laga", "laga"), kernel="eager", shape=SHAPE)
    plain = run_on_rank(case, 0, 1, None)
    measured = run_on_rank(case, 0, 1, None, cpu_peak=True)
    assert plain["peak_bytes"] is None and "cpu_peak=False" in plain["peak_reason"]
    assert measured["peak_reason"] is None
    assert measured["peak_bytes"] >= _end_of_pass_bytes(SHAPE, SHAPE.seq_len) > 0
    # The extra pass changes nothing the timed runs report.
    assert torch.equal(plain["out"], measured["out"])
    assert all(torch.equal(plain["grads"][k], measured["grads"][k]) for k in plain["grads"])
    assert plain["saved_bytes"] == measured["saved_bytes"] and plain["comm"] == measured["comm"]


@pytest.mark.timeout(120)
def test_bench_prints_a_measured_peak_on_cpu(tmp_path):
    """2 gloo ranks, the three forms: every row's peak is a number in the table and the
    JSON, at least what the pass still holds at its end on a rank (half the sequence)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["bench", "--cp", "2", "--cp-algo", "allgather", "--forms-only",
                         "--seq-lens", str(SHAPE.seq_len), "--micro-batch", str(SHAPE.batch),
                         "--heads", str(SHAPE.heads), "--qk-head-dim", str(SHAPE.qk_head_dim),
                         "--qk-pos-emb-head-dim", str(SHAPE.rope_dim),
                         "--v-head-dim", str(SHAPE.v_head_dim), "--kv-lora-rank", str(SHAPE.kv_lora_rank),
                         "--repeat", "1", "--warmup", "0", "--json", str(tmp_path / "b.json"), "--plot", ""])
    assert code == 0
    text = out.getvalue()
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["explicit", "absorbed", "laga"]
    table = [line.split() for line in text.splitlines()]
    for r in rows:
        assert r["max_rel_err"] < 1e-5, r["variant"]
        assert r["peak_bytes"] >= _end_of_pass_bytes(SHAPE, SHAPE.seq_len // 2), r["variant"]
        assert r["peak_mib"] == f"{r['peak_bytes'] / MiB:.2f}" and r["peak_reason"] is None
        assert r["peak_measured_over_model"] == f"{r['peak_bytes'] / r['model_peak_bytes']:.2f}x"
        line = next(cells for cells in table if cells and cells[0] == r["variant"])
        assert r["peak_mib"] in line
    assert "peak: the CPU allocator's peak above the inputs" in text and "n/a" not in text

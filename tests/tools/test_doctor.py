"""``mindspeed-laga doctor`` on CPU: spawned gloo ranks, the torch_npu stand-in, an
injected mismatch, bad arguments, and the environment probes.

The figures checked are independent of the doctor: bytes from the tensor shapes
by hand, errors against the tolerance the doctor states, exit codes.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import pytest
import torch

from mindspeed_laga.tools import cli
from mindspeed_laga import kernels
from mindspeed_laga.tools.commands import environment, exactness

from support import fake_torch_npu
from support.cli_runs import assert_one_line_error, run_cli
from support.variants import KERNELS

CP, CHECK_S = 2, 16


@pytest.fixture
def fake_npu():
    module = fake_torch_npu.install()
    yield module
    fake_torch_npu.uninstall()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One full doctor run (fake torch_npu installed, 2 spawned gloo ranks)."""
    out = tmp_path_factory.mktemp("doctor")
    fake_torch_npu.install()
    printed = io.StringIO()
    try:
        # the bench runs in test_under_torchrun
        with contextlib.redirect_stdout(printed):
            rc = cli.main(["doctor", "--cp", str(CP), "--check-seq-len", str(CHECK_S), "--no-bench",
                           "--json", str(out / "d.json"), "--markdown", str(out / "d.md")])
    finally:
        fake_torch_npu.uninstall()

    with open(out / "d.json") as f:
        doc = json.load(f)
    with open(out / "d.md") as f:
        md = f.read()
    return rc, doc, md, printed.getvalue()


@pytest.mark.timeout(120)
def test_full_run_passes_and_reports_environment(report):
    rc, doc, md, _ = report
    assert rc == 0 and doc["passed"] is True
    env = doc["environment"]
    assert env["torch"] == torch.__version__
    assert env["python"] == ".".join(map(str, sys.version_info[:3]))
    assert env["torch_npu"] == "0.0.0+fake" and env["device"] == "cpu"
    assert doc["laga_paths"]["npu kernel"] == "available"
    assert doc["laga_paths"]["npu unpadded V (pad_v=False)"].startswith("works")
    assert doc["laga_paths"]["npu padded V (pad_v=True)"].startswith("works")
    for heading in ("## Environment", "## LAGA paths", "## Exactness", "## Context parallelism"):
        assert heading in md
    assert f"| torch | {torch.__version__} |" in md


@pytest.mark.timeout(120)
def test_printed_summary_says_each_thing_once_and_where_to_send_it(report):
    """The pass count once, notes only about columns the printed tables have, and the
    Markdown's destination named."""
    _, doc, md, text = report
    count = f"{len(doc['exactness'])}/{len(doc['exactness'])}"
    assert text.count(count) == 1, text
    notes = [line for line in text.splitlines() if line.startswith("bytes: rank 0's payload")]
    assert len(notes) == 1 and "saved:" not in notes[0]
    assert "to us" not in text and "issue tracker" in text
    assert "saved: activations autograd keeps" in md  # the Markdown's bench table has the column


@pytest.mark.timeout(120)
def test_exactness_rows_cover_every_path_and_pass(report):
    _, doc, md, _ = report
    rows = doc["exactness"]
    assert all(r["status"] == "pass" and r["max_rel_err"] <= r["tolerance"] for r in rows)
    seen = {(r["form"], r["kernel"], r["shape"]) for r in rows if r["kind"] == "reference"}
    for form in ("explicit", "absorbed", "laga"):
        for kernel in KERNELS:
            for shape in ("small", "deepseek_dims"):
                assert (form, kernel, shape) in seen
    options = {tuple(sorted(r["options"])) for r in rows if r["form"] == "laga"}
    assert ("kv_block_size", "recompute_kv", "trim_causal_prefix") in options
    assert ("trim_causal_prefix",) in options
    assert any(r["documents"] for r in rows)
    npu = [r for r in rows if r["kernel"] == "npu"]
    assert {r["pad_v"] for r in npu} == {True, False}
    assert {r["kernel"] for r in rows if r["kind"] == "lse_merge"} == {"eager", "sdpa", "npu"}
    assert md.count("| pass |") >= len(rows)


@pytest.mark.timeout(120)
def test_cp_rows_match_reference_and_bytes_by_hand(report):
    _, doc, _, _ = report
    cp = {(r["variant"], r["cp_algo"]): r for r in doc["cp"]}
    assert all(r["passed"] for r in cp.values()) and len(cp) == 16
    heads, d_n, d_r, d_v, d_c = 16, 16, 8, 16, 64       # the CP check's shape (CPU dims)
    local = CHECK_S // CP
    # allgather: explicit gathers per-head K and V, LAGA the latent and rope key (float32)
    explicit = local * heads * (d_n + d_r + d_v) * 4
    latent = local * (d_c + d_r) * 4
    for direction in ("forward", "backward"):
        assert cp["explicit", "allgather"][f"{direction}_bytes"] == explicit
        assert cp["laga", "allgather"][f"{direction}_bytes"] == latent
        assert cp["laga", "allgather"][f"explicit_over_form_{direction}"] == pytest.approx(explicit / latent)


@pytest.mark.timeout(120)
def test_injected_mismatch_exits_nonzero(monkeypatch, tmp_path, capsys):
    """The eager kernel returns 1% too much: its rows fail, the others pass, exit 1."""
    small = [c for c in exactness.plan(["eager", "sdpa"], ["float32"], False) if c.shape == "small"]
    monkeypatch.setattr(exactness, "plan", lambda *a: small)
    from mindspeed_laga.kernels.declared.eager import Eager
    right = Eager.attend_segment
    monkeypatch.setattr(Eager, "attend_segment",
                        lambda *a, **k: right(*a, **k) * 1.01)
    path = tmp_path / "d.json"
    rc = cli.main(["doctor", "--cp", "2", "--check-seq-len", "8", "--no-bench", "--json", str(path)])
    assert rc == 1
    doc = json.loads(path.read_text())
    failed = [r for r in doc["exactness"] if not r["passed"]]
    assert failed and all(r["kernel"] == "eager" and r["status"] == "FAIL" for r in failed)
    assert all(r["max_rel_err"] > 1e-3 for r in failed)
    assert any(r["passed"] for r in doc["exactness"] if r["kernel"] == "sdpa")
    assert "FAIL" in capsys.readouterr().out


def test_a_rank_that_raises_is_a_reported_failure(monkeypatch, tmp_path, capsys):
    """A CP run that raises on a rank (a kernel the node's stack rejects) ends in the
    report and exit 1, not in a traceback."""
    from mindspeed_laga.tools.commands import doctor
    small = exactness.plan(["eager"], ["float32"], False)[:2]
    monkeypatch.setattr(exactness, "plan", lambda *a: small)

    def failing_run(self, fn, *args):
        raise doctor.RankError("rank 1: RuntimeError: the op rejected head dim 128")
    monkeypatch.setattr(doctor.Ranks, "run", failing_run)
    md = tmp_path / "d.md"
    rc = cli.main(["doctor", "--cp", "2", "--check-seq-len", "8", "--markdown", str(md)])
    captured = capsys.readouterr()
    assert rc == 1 and "Traceback" not in captured.err
    assert "rejected head dim 128" in captured.out
    text = md.read_text()
    assert "doctor: FAIL" in text
    assert "## Error in the cp runs" in text and "## Error in the bench runs" in text


def test_defaults_fit_any_cp_size():
    """Default lengths and heads round up to what zigzag (2*CP chunks) and ulysses split."""
    from mindspeed_laga.tools.commands import doctor
    args = doctor.resolve(cli.build_parser().parse_args(["doctor", "--cp", "3"]))
    assert args.seq_len % 6 == 0 and args.check_seq_len % 6 == 0
    assert args.heads % 3 == 0 and args.check_heads % 3 == 0
    assert args.seq_len >= 256 and args.heads >= 16


@pytest.mark.parametrize("argv, words", [
    (["--cp", "4", "--seq-len", "36"], "--seq-len"),                # not a multiple of 2*CP
    (["--cp", "2", "--heads", "3"], "--heads"),                     # ulysses splits heads
    (["--json", "/no/such/dir/d.json"], "--json"),
    (["--markdown", "/no/such/dir/d.md"], "--markdown"),
    (["--warmup", "-1"], "--warmup"),
    (["--cp", "0"], "0"),
])
def test_bad_arguments_one_line_before_running(argv, words, monkeypatch, capsys):
    def must_not_run(*a, **k):
        raise AssertionError("ran before checking the arguments")
    monkeypatch.setattr(exactness, "run_all", must_not_run)
    code, _, err = run_cli(capsys, "doctor", *argv)
    assert_one_line_error("doctor", code, err, words)


def test_npu_rows_cover_both_v_layouts_and_documents_only_where_the_build_has_them():
    """The NPU kernel is checked with V padded and unpadded; its packed-document rows exist
    only where torch_npu has the varlen layout; eager's rows never depend on it."""
    def rows(kernel, documents):
        return exactness.plan([kernel], ["float32"], documents)
    labels = [c.label() for c in rows("npu", True)]
    assert any(x.endswith(" padded V") for x in labels) and any(x.endswith("unpadded V") for x in labels)
    assert any(c.documents for c in rows("npu", True))
    assert not any(c.documents for c in rows("npu", False))
    assert rows("eager", False) == rows("eager", True) and any(c.documents for c in rows("eager", False))
    assert not any("V" in c.label().split() for c in rows("eager", False))


def test_blockwise_kernel_notes():
    """What the doctor says of each kernel's block kernel (laga_paths)."""
    notes = {name: k.block_note for name, k in kernels.KERNEL_TYPES.items()}
    assert notes == {"npu": "", "sdpa": "fused block ops", "eager": "no fused block op, eager math"}


def test_without_torch_npu_no_npu_rows(monkeypatch):
    monkeypatch.setattr(environment, "torch_npu_module", lambda: None)
    paths = environment.laga_paths(torch.device("cpu"))
    assert paths["npu kernel"].startswith("not available")
    assert "recompute_kv block kernel (float32)" in paths


def test_a_kernel_rejected_by_design_is_na_not_a_failure():
    """recompute_kv with kernel 'sdpa' needs a fused block op; on a device without one the
    package raises ValueError by design: the row says so and does not fail."""
    check = exactness.Check(form="laga", kernel="sdpa", dtype="float32", shape="small",
                            options=(("recompute_kv", True),))
    row = exactness.run_check(check, torch.device("meta"))
    assert row["status"] == "n/a" and row["passed"] and "recompute_kv" in row["error"]
    assert exactness.run_check(check, torch.device("cpu"))["status"] == "pass"


def test_git_head_and_cann_version(tmp_path, monkeypatch):
    sha = "0123456789abcdef0123456789abcdef01234567"
    git = tmp_path / "repo" / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text(sha + "\n")
    pkg = tmp_path / "repo" / "pkg"
    pkg.mkdir()
    assert environment.git_head(str(pkg)) == sha[:12]
    installed = tmp_path / "repo" / "lib" / "site-packages" / "pkg"
    installed.mkdir(parents=True)
    assert environment.git_head(str(installed)) is None
    toolkit = tmp_path / "toolkit"
    (toolkit / "aarch64-linux").mkdir(parents=True)
    (toolkit / "aarch64-linux" / "ascend_toolkit_install.info").write_text(
        "package_name=Ascend-cann-toolkit\nversion=8.1.RC1\narch=aarch64\n")
    monkeypatch.setenv("ASCEND_HOME_PATH", str(toolkit))
    monkeypatch.setattr(environment, "torch_npu_module", lambda: None)
    assert environment.cann_version().startswith("8.1.RC1")


@pytest.mark.timeout(150)
def test_under_torchrun(tmp_path):
    """``torchrun -m mindspeed_laga doctor``: every rank checks its device, the CP runs
    use the launched group (gloo here), rank 0 writes the report."""
    import subprocess
    path = tmp_path / "d.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "-m", "mindspeed_laga",
           "doctor", "--check-seq-len", "8", "--seq-len", "8", "--repeat", "1", "--warmup", "0",
           "--json", str(path), "--markdown", str(tmp_path / "d.md")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=140, cwd=tmp_path,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    doc = json.loads(path.read_text())
    assert doc["passed"] and doc["run"]["cp"] == "torchrun, 2 ranks, backend gloo"
    assert all(r["ranks_failed"] == [] for r in doc["exactness"])
    assert len(doc["cp"]) == 16 and all(r["passed"] for r in doc["cp"])
    bench = doc["bench"]
    assert len(bench) == 16 and {r["seq_len"] for r in bench} == {8}
    assert all(r["peak_bytes"] > 0 and r["ms"] > 0 for r in bench)  # CPU: the allocator's peak
    md = (tmp_path / "d.md").read_text()
    assert "## Bench (S=8" in md and "| n/a |" not in md

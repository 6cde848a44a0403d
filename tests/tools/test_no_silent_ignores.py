"""Every CLI flag acts or is refused in one line (exit 2): --cp against torchrun's world size,
--backend outside torchrun, --plot without matplotlib, CP sizes the machine cannot spawn,
an output path under a regular file; verify's hybrid CP; --help without torch; the bench
header once under torchrun; ``doctor --json -`` prints only JSON."""
import json
import os
import subprocess
import sys
import time
from argparse import Namespace

import pytest

from mindspeed_laga.tools import rank_cap
from mindspeed_laga.tools.commands import bench, plot
from support.cli_runs import assert_one_line_error, run_cli

TINY = ["--heads", "4", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8",
        "--kv-lora-rank", "16"]


@pytest.fixture
def torchrun_env(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")


@pytest.mark.parametrize("command", ["bench", "doctor"])
def test_cp_other_than_torchruns_world_size_is_refused(capsys, torchrun_env, command):
    code, out, err = run_cli(capsys, command, "--cp", "2")
    assert_one_line_error(command, code, err, "--cp 2 differs from torchrun's world size 4")


@pytest.mark.parametrize("command", ["bench", "doctor"])
def test_backend_outside_torchrun_is_refused(capsys, monkeypatch, command):
    monkeypatch.delenv("RANK", raising=False)
    code, out, err = run_cli(capsys, command, "--backend", "hccl")
    assert_one_line_error(command, code, err, "--backend hccl applies under torchrun only")


def test_plot_without_matplotlib(capsys, monkeypatch):
    monkeypatch.setattr(plot, "matplotlib_missing", lambda: True)
    monkeypatch.setattr(bench, "matplotlib_missing", lambda: True)
    code, out, err = run_cli(capsys, "bench", "--plot", "b.png", "--cp", "2", *TINY)
    assert_one_line_error("bench", code, err, "--plot 'b.png' needs matplotlib")
    args = Namespace(plot=None)  # the default plot: skipped, said before the run
    note = bench.resolve_plot(args)
    assert args.plot == "" and note.startswith("plot: none (matplotlib is not installed")


@pytest.mark.parametrize("command", ["bench", "verify", "doctor"])
def test_cp_beyond_what_the_machine_holds_is_refused_at_once(capsys, monkeypatch, command):
    """2 cores and 24 GiB (the machine the refusal was missing on): 16 ranks at most."""
    monkeypatch.setattr(rank_cap, "cores", lambda: 2)
    monkeypatch.setattr(rank_cap, "available_mib", lambda: 24 * 1024)
    for cp in ("512", "100000"):
        start = time.perf_counter()
        code, out, err = run_cli(capsys, command, "--cp", cp)
        assert time.perf_counter() - start < 5
        assert_one_line_error(command, code, err, f"--cp {cp} spawns {cp} CPU processes, but this "
                                                  "machine holds at most 16 (2 cores x 8")
    monkeypatch.setattr(rank_cap, "available_mib", lambda: 1024)  # memory binds first: 3
    code, out, err = run_cli(capsys, command, "--cp", "4")
    assert_one_line_error(command, code, err, "holds at most 3")


def test_a_path_under_a_regular_file_is_named(capsys, tmp_path):
    blocker = tmp_path / "results"
    blocker.write_text("")
    code, out, err = run_cli(capsys, "bench", "--cp", "2", "--json", str(blocker / "sub" / "b.json"))
    assert_one_line_error("bench", code, err, f"{str(blocker)!r} is a file, not a directory")


@pytest.mark.timeout(300)
def test_verify_runs_hybrid(capsys):
    code, out, err = run_cli(capsys, "verify", "--cp", "4", "--cp-algo", "hybrid", "--ulysses-degree",
                             "2", "--seq-len", "32", "--repeat", "1", *TINY)
    assert code == 0, err
    rows = [line.split() for line in out.splitlines() if line.split()[:2][-1:] == ["hybrid"]]
    assert [r[0] for r in rows] == ["explicit", "absorbed", "laga"], out
    assert "CP=4 gloo ranks (hybrid U=2)" in out and "OK: every form matches" in out
    code, out, err = run_cli(capsys, "verify", "--cp-algo", "hybrid")
    assert_one_line_error("verify", code, err, "--cp-algo hybrid needs --ulysses-degree")


@pytest.mark.parametrize("command", ["", "plan", "verify", "bench", "doctor"])
def test_help_does_not_import_torch(command):
    """--help parses and prints before anything imports torch (seconds on a loaded machine):
    the parser reads the kernels' declarations (kernels/declared/), not what they run."""
    code = ("import sys\nfrom mindspeed_laga.tools import cli\n"
            f"try:\n    cli.main([{command!r}, '--help'] if {command!r} else ['--help'])\n"
            "except SystemExit:\n    pass\n"
            "print('torch imported:', sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().endswith("torch imported: []"), proc.stdout[-500:] + proc.stderr


def test_doctor_json_dash_prints_only_json(monkeypatch, capsys):
    from mindspeed_laga.tools.commands import doctor, exactness
    small = exactness.plan(["eager"], ["float32"], False)[:2]
    monkeypatch.setattr(exactness, "plan", lambda *a: small)

    def failing_run(self, fn, *args):
        raise doctor.RankError("rank 1: RuntimeError: stand-in failure")
    monkeypatch.setattr(doctor.Ranks, "run", failing_run)
    code, out, err = run_cli(capsys, "doctor", "--cp", "2", "--check-seq-len", "8", "--json", "-")
    assert code == 1
    doc = json.loads(out)  # stdout is the JSON and nothing else
    assert "stand-in failure" in doc["errors"]["cp"]
    assert "doctor: exactness on" in err and "environment:" in err


@pytest.mark.timeout(300)
def test_bench_header_once_under_torchrun(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "mindspeed_laga.tools.cli", "bench", "--cp-algo", "allgather", "--forms-only",
         "--seq-lens", "32", "--repeat", "1", "--warmup", "0", "--json", "", "--plot", "", *TINY],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("bench: torchrun, world size 2") == 1, proc.stdout


# What the user typed, not what differs from a default: each a one-line refusal.
TYPED = [
    (["plan", "--seq-len", "4096", "--seq-len", "8192"], "--seq-len is given 2 times"),
    (["bench", "--seq-len", "128", "--seq-lens", "256"], "--seq-len and --seq-lens name one option"),
    (["plan", "--dsa", "glm-5", "--preset", "deepseek-v3"], "drop --preset"),  # = its default
    (["bench", "--dsa", "glm-5", "--kv-lora-rank", "64"], "drop --kv-lora-rank"),  # = its default
    (["bench", "--dsa", "glm-5", "--qk-pos-emb-head-dim", "8"], "drop --qk-pos-emb-head-dim"),
    (["plan", "--preset", "deepseek-v3.2"], "use --dsa deepseek-v3.2"),
    (["plan", "--preset", "glm-5.2"], "use --dsa glm-5.2"),
]


@pytest.mark.parametrize("argv, words", TYPED, ids=[" ".join(a) for a, _ in TYPED])
def test_what_the_user_typed_is_refused_in_one_line(capsys, argv, words):
    code, out, err = run_cli(capsys, *argv)
    assert_one_line_error(argv[0], code, err, words)
    assert out == ""


# Refusals bench and verify can make from the values alone: before torch is imported.
BEFORE_TORCH = [
    ["bench", "--warmup", "-1"], ["bench", "--kernel", "npu"], ["bench", "--seq-lens", "10000000"],
    ["bench", "--seq-lens", "100", "--cp", "3"], ["bench", "--json", "-", "--plot", "-"],
    ["bench", "--dsa", "glm-5", "--seq-lens", "65536", "--cp", "2"],
    ["verify", "--seq-len", "1000000000000"], ["verify", "--seq-len", "4000000"],
    ["verify", "--cp", "3"], ["verify", "--cp-algo", "ulysses", "--heads", "5"],
]


def test_refusals_come_before_torch_is_imported():
    """Each is refused with one line, exit 2, and torch was never imported (seconds saved)."""
    code = ("import sys\nfrom mindspeed_laga.tools import cli\n"
            f"codes = [cli.main(argv) for argv in {BEFORE_TORCH!r}]\n"
            "print('codes', codes, 'torch imported:', 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip() == f"codes {[2] * len(BEFORE_TORCH)} torch imported: False", \
        proc.stdout[-500:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == len(BEFORE_TORCH) and all(": error: " in ln for ln in lines), lines
    verify_fit = [ln for ln in lines if ln.startswith("mindspeed-laga verify: error: --seq-len")]
    assert any("S=4000000 needs about" in ln for ln in verify_fit), lines
    assert any("3,037,000,499" in ln for ln in verify_fit), lines

"""``doctor`` writes one report per path, and ``verify``, which spawns its own ranks, is
refused under torchrun instead of running the whole check once per torchrun rank."""
from __future__ import annotations

import pytest
from support.cli_runs import assert_one_line_error, run_cli


@pytest.mark.parametrize("markdown", ["report", "./report", "sub/../report"])
def test_doctor_refuses_one_path_for_json_and_markdown(capsys, tmp_path, monkeypatch, markdown):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    code, _, err = run_cli(capsys, "doctor", "--json", "report", "--markdown", markdown, "--no-bench")
    assert_one_line_error("doctor", code, err, "name one file")
    assert not (tmp_path / "report").exists()  # refused before anything ran or was written


@pytest.mark.parametrize("rank", ["0", "1"])
def test_verify_under_torchrun_is_refused_before_any_rank_once_per_job(capsys, monkeypatch, rank):
    """Every rank refuses (exit 2); only rank 0 prints the line, so a job prints it once."""
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, _, err = run_cli(capsys, "verify", "--cp", "2")
    if rank == "0":
        assert_one_line_error("verify", code, err, "without torchrun")
    else:
        assert code == 2 and err == ""


@pytest.mark.parametrize("argv", [["bench", "--json", "-", "--plot", "-"],
                                  ["doctor", "--json", "-", "--markdown", "-", "--no-bench"]],
                         ids=["bench", "doctor"])
def test_two_reports_on_stdout_are_refused(capsys, argv):
    code, out, err = run_cli(capsys, *argv)
    assert_one_line_error(argv[0], code, err, "both name standard output")
    assert out == ""


def test_doctor_markdown_dash_is_the_markdown_alone_on_stdout(monkeypatch, capsys, tmp_path):
    """``--markdown -`` writes no file named '-': stdout is the Markdown, the rest stderr."""
    from mindspeed_laga.tools.commands import doctor, exactness
    monkeypatch.chdir(tmp_path)
    small = exactness.plan(["eager"], ["float32"], False)[:2]
    monkeypatch.setattr(exactness, "plan", lambda *a: small)

    def failing_run(self, fn, *args):
        raise doctor.RankError("rank 1: RuntimeError: stand-in failure")
    monkeypatch.setattr(doctor.Ranks, "run", failing_run)
    code, out, err = run_cli(capsys, "doctor", "--cp", "2", "--check-seq-len", "8", "--markdown", "-")
    assert code == 1
    assert out.startswith("# mindspeed-laga doctor") and "stand-in failure" in out
    assert "doctor: exactness on" in err and "doctor: exactness on" not in out
    assert not (tmp_path / "-").exists()


def test_a_closed_pipe_ends_quietly():
    """The reader gone before the first line (``| head`` done): no traceback, no error line,
    the exit status of a writer killed by SIGPIPE."""
    import os
    import signal
    import subprocess
    import sys
    read, write = os.pipe()
    os.close(read)  # nobody reads: the first write fails
    proc = subprocess.run([sys.executable, "-m", "mindspeed_laga.tools.cli", "plan"], stdout=write,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert proc.stderr == "" and proc.returncode == 128 + signal.SIGPIPE, proc.stderr[-2000:]


def test_version_prints_the_installed_version(capsys):
    from importlib.metadata import version
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.strip() == f"mindspeed-laga {version('mindspeed-laga')}"



def test_a_peer_rank_probing_the_same_path_is_waited_out(tmp_path, monkeypatch):
    """Under torchrun every rank proves the report path writable (makes, writes and removes
    the file) before anything runs. The interleaving they can meet: a peer's probe appears
    between this rank's look and its open, and is gone a moment later. No refusal, no file
    left behind."""
    import os

    from mindspeed_laga.tools.commands import output
    path = tmp_path / "d.json"
    looks, exists = [], os.path.exists

    def look(p):
        if os.fspath(p) == str(path) and not looks:
            looks.append(p)
            path.write_bytes(b"\0")  # the peer's probe, made right after this look
            return False
        return exists(p)

    monkeypatch.setattr(output.os.path, "exists", look)
    monkeypatch.setattr(output.time, "sleep", lambda s: path.unlink(missing_ok=True))  # peer done
    output.check_output_path("--json", str(path))
    assert looks and not path.exists()

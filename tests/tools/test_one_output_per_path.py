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

"""Every recipe script checks its environment values before it launches (DRY_RUN=1 too),
each refusal one line and exit 2; a run from the wrong directory stops before any rank;
the launch is torchrun, and the dry run prints one flag a line."""
import os
import subprocess
import time

import pytest

from support.laga_scripts import SCRIPTS

NAMES = ("pretrain_deepseek3_laga.sh", "tune_deepseek3_laga.sh", "pretrain_deepseek3_128k_laga.sh")


def run(name, cwd=None, **env):
    return subprocess.run(["bash", str(SCRIPTS / name)], env=dict(os.environ, **env), cwd=cwd,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("env, words", [
    ({"LAGA": "yes"}, "LAGA=yes: must be 0 or 1"),
    ({"LAGA_TRIM": "true"}, "LAGA_TRIM=true: must be 0 or 1"),
    ({"CP": "3", "CP_TYPE": "ulysses_cp_algo"}, "CP=3 must divide the"),
    ({"CP": "two"}, "CP=two: must be a positive integer"),
    ({"SEQ_LEN": "4100", "CP": "4", "CP_TYPE": "megatron_cp_algo"}, "SEQ_LEN=4100 must be a multiple of 2*CP=8"),
    ({"SEQ_LEN": "4098", "CP": "4", "CP_TYPE": "ulysses_cp_algo"}, "SEQ_LEN=4098 must be a multiple of CP=4"),
    ({"CP": "4", "CP_TYPE": "hybrid_cp_algo", "ULYSSES_DEGREE": "3"}, "ULYSSES_DEGREE=3 must divide CP=4"),
    ({"CP": "4", "CP_TYPE": "hybrid_cp_algo"}, "needs ULYSSES_DEGREE=U"),
    ({"ULYSSES_DEGREE": "2", "CP_TYPE": "ulysses_cp_algo"}, "goes with CP_TYPE=hybrid_cp_algo"),
    ({"CP_TYPE": "ring"}, "CP_TYPE=ring: use"),
    ({"LAGA_BLOCK": "-5"}, "LAGA_BLOCK=-5: must be a positive integer"),
])
def test_bad_values_stop_the_dry_run_in_one_line(name, env, words):
    proc = run(name, DRY_RUN="1", **env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-500:]
    assert lines == [f"{name}: {lines[0].split(': ', 1)[1]}"] and words in lines[0], proc.stderr


@pytest.mark.parametrize("name, switch", [("pretrain_deepseek3_laga.sh", "RESET_MASK"),
                                          ("tune_deepseek3_laga.sh", "PACKED")])
def test_the_scripts_own_switches_are_checked(name, switch):
    proc = run(name, DRY_RUN="1", **{switch: "on"})
    assert proc.returncode == 2 and f"{switch}=on: must be 0 or 1" in proc.stderr


@pytest.mark.parametrize("name", NAMES)
def test_wrong_directory_stops_before_any_rank(name, tmp_path):
    start = time.perf_counter()
    proc = run(name, cwd=tmp_path, LAGA="0", MINDSPEED_LLM_DIR=str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-1000:]
    assert proc.stderr.strip().splitlines() == [
        f"{name}: {tmp_path}/pretrain_gpt.py not found: run from the MindSpeed-LLM checkout or set "
        "MINDSPEED_LLM_DIR".replace("pretrain_gpt", "posttrain_gpt" if name.startswith("tune") else "pretrain_gpt")]
    assert time.perf_counter() - start < 20 and not (tmp_path / "logs").exists()


@pytest.mark.parametrize("name", NAMES)
def test_dry_run_is_torchrun_one_flag_a_line(name):
    proc = run(name, DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "torchrun \\"
    assert all(line.startswith("    ") for line in lines[1:])
    assert all(line.endswith(" \\") for line in lines[:-1]) and not lines[-1].endswith("\\")
    for line in lines[1:]:
        tokens = line.strip().rstrip(" \\").split()
        assert sum(t.startswith("--") for t in tokens) <= 1, line
    assert "torch.distributed.launch" not in proc.stdout

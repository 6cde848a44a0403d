"""The CPU demo checks its configuration before torchrun starts: one line naming the flag."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.mcore  # the leg that runs it (tests/conftest.py)


def _demo(timeout=120, *extra, **env):
    env = dict(os.environ, **{"PYTHON": sys.executable, **env})
    return subprocess.run(["bash", str(ROOT / "scripts" / "train_tiny_cpu.sh"), *extra], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("env, extra, words", [
    (dict(NPROC="3", CP_ALGO="ulysses"), (), ["--cp-algo ulysses", "4 heads", "CP=3"]),
    (dict(NPROC="3", CP_ALGO="allgather"), (), ["--seq-length 64", "not divisible by 6"]),
    (dict(NPROC="4", CP_ALGO="hybrid"), (), ["--ulysses-degree U (ULYSSES_DEGREE)"]),
    (dict(NPROC="4", CP_ALGO="hybrid", ULYSSES_DEGREE="3"), (), ["dividing both CP=4", "got 3"]),
    (dict(NPROC="2"), ("--tp", "3"), ["--tp 3 must divide the world size 2"]),
    (dict(NPROC="2", LAGA="0"), ("--layout", "contiguous"), ["without --laga"]),
    (dict(NPROC="2", LAGA="yes"), (), ["LAGA=yes: must be 0 or 1"]),
    (dict(NPROC="two"), (), ["NPROC=two: must be a positive integer"]),
    (dict(NPROC="2", PYTHON="no-such-python"), (), ["PYTHON=no-such-python: not a command"]),
    (dict(NPROC="2", FORM="fast"), (), ["--form", "fast"]),
])
def test_bad_configuration_fails_in_one_line_before_torchrun(env, extra, words):
    proc = _demo(120, *extra, **env)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train_tiny_cpu: error:"), proc.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert proc.stdout == ""  # nothing was built or trained

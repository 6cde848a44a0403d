"""The CPU stand-ins of an NPU host (tests/support/npu_host.py) behave as documented and
reject what the real host rejects. The checks run in one fresh interpreter
(tests/support/loop/npu_host_checks.py), because installing the stand-ins changes torch itself."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.loop import npu_host_checks

pytestmark = [pytest.mark.ascend, pytest.mark.loop, pytest.mark.hosts]


@pytest.fixture(scope="module")
def results():
    done = subprocess.run([sys.executable, str(Path(npu_host_checks.__file__))], timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(360)
@pytest.mark.parametrize("name", list(npu_host_checks.CHECKS))
def test_stand_in(results, name):
    assert results[name] == "ok", results[name]

"""The registries are the one place a kernel or a CP algorithm is named: in a temporary copy
of the package, one new kernel file plus its registration (an import and an entry in
``kernels/registry.py``), and one new CP-algorithm file plus its registration in
``cp_algos/__init__.py``, are accepted by the core, ``verify``, ``bench`` and the tests'
equivalence axis with no other edit (docs/DESIGN.md, "Extension points").

The new kernel is an eager kernel under another name and the new algorithm a renamed
allgather, so ``verify`` (which runs the three forms on two gloo ranks against the float64
reference) must pass with them; a registry that lists them without wiring them through
fails here by rejecting the flag, building no case, or erroring at run time.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mindspeed_laga

REPO = Path(mindspeed_laga.__file__).resolve().parent.parent
SUPPORT = REPO / "tests"

KERNEL_FILE = '''"""A new kernel for the registry test: the eager math under its own name."""
from .eager import Eager


class Chunked(Eager):
    name = "chunked"
'''
ALGO_FILE = '''"""A new CP algorithm for the registry test: allgather under its own name."""
from .allgather import AllGather


class Gathered(AllGather):
    name = "gathered"
'''
# What the test runs inside the copy: each reader asked, then one real verify run.
PROBE = '''
import sys
from mindspeed_laga.kernels import registry
from mindspeed_laga.tools import cli
from mindspeed_laga.tools.commands import bench, verify
from support import variants

assert registry.__file__.startswith(sys.argv[1]), registry.__file__  # the copy is imported
assert "chunked" in variants.CPU_KERNELS and "chunked" in variants.KERNELS
assert "gathered" in variants.PLAIN_ALGOS
parser = cli.build_parser()
args = parser.parse_args(["verify", "--kernel", "chunked", "--cp-algo", "gathered"])
assert {(c.kernel, c.cp_algo) for c in verify.cases_from_args(args)} == {("chunked", "gathered")}
both = verify.cases_from_args(parser.parse_args(["verify"]))
assert "gathered" in {c.cp_algo for c in both}
args = parser.parse_args(["bench", "--kernel", "chunked", "--cp-algo", "gathered", "--cp", "2",
                          "--seq-lens", "32", "--heads", "2"])
runs, models = bench.build_runs(args, 2, "cpu")
assert runs and {c.cp_algo for c in runs} == {"gathered"}
assert "chunked" in {c.kernel for c in runs} and {m.kernel for m in models} >= {"eager"}
sys.exit(cli.main(["verify", "--cp", "2", "--seq-len", "32", "--heads", "2", "--repeat", "1",
                   "--kernel", "chunked", "--cp-algo", "gathered"]))
'''


def _register(path: Path, anchor: str, import_line: str, entry: str) -> None:
    """The registration: ``import_line`` above ``anchor`` and ``entry`` as the tuple's last."""
    text = path.read_text()
    assert text.count(anchor) == 1 and text.count("\n)\n") >= 1
    text = text.replace(anchor, import_line + anchor)
    head, tail = text.split("_REGISTERED = (", 1)
    body, rest = tail.split("\n)\n", 1)
    path.write_text(f"{head}_REGISTERED = ({body}\n    {entry},\n){chr(10)}{rest}")


@pytest.mark.timeout(300)
def test_one_file_and_its_registration_is_all_a_kernel_or_algorithm_takes(tmp_path):
    copy = tmp_path / "mindspeed_laga"
    shutil.copytree(REPO / "mindspeed_laga", copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "kernels" / "chunked.py").write_text(KERNEL_FILE)
    _register(copy / "kernels" / "registry.py", "from .npu import Npu\n",
              "from .chunked import Chunked\n", "Chunked")
    (copy / "cp_algos" / "gathered.py").write_text(ALGO_FILE)
    _register(copy / "cp_algos" / "__init__.py", "from .hybrid import Hybrid\n",
              "from .gathered import Gathered\n", "Gathered()")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(SUPPORT)]))
    proc = subprocess.run([sys.executable, "-c", PROBE, str(copy)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: every form matches the reference" in proc.stdout
    assert proc.stdout.count("gathered") >= 3  # explicit, absorbed and LAGA ran it

"""docs/DESIGN.md's "Extension points", done as it says in a copy of the whole repository:

- a dense kernel ``sdpa2`` (built on ``Sdpa``: one file in ``kernels/declared/`` and its
  registration),
- a CP algorithm built on ``AllGather``, twice: ``kvgather`` in the tables and
  ``kvgather_own`` outside them (``in_tables = False``), each one file and its registration,
- a release ``26.1.1`` the same as 26.1.0 (one row, ``same_as``; its archives in the tests'
  archive folder, here 26.1.0's under 26.1.1's names),
- a sparse stage kernel built on the torch one (one file and its registration),

then ``plan``, ``verify``, ``bench`` (dense and ``--dsa``) and the test modules that read each
registry run there, unedited, and pass. A tool or test that keeps its own list of names (a
second name table, a literal kernel or release list, a module-level assert on the rows)
fails here: the new entry is missing from it, or breaks it.

The new entries run the code of the ones they are built on, so every comparison they meet
holds; the test modules run only their cases that name a new entry (``-k``) where a whole
module would take minutes, and the smallest shapes.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mindspeed_laga
from support import thirdparty

REPO = Path(mindspeed_laga.__file__).resolve().parent.parent

# path in the copy -> the new file (each exactly as DESIGN.md's table says)
FILES = {
    "mindspeed_laga/kernels/declared/sdpa2.py": '''"""A new kernel: SDPA's calls under its own name."""
from .sdpa import Sdpa


class Sdpa2(Sdpa):
    name = "sdpa2"
''',
    "mindspeed_laga/cp_algos/kvgather.py": '''"""New CP algorithms: allgather under other names, in the tables and outside them."""
from .allgather import AllGather


class KvGather(AllGather):
    name = "kvgather"


class KvGatherOwn(AllGather):
    name = "kvgather_own"
    in_tables = False
''',
    "mindspeed_laga/sparse/torch2_stages.py": '''"""A new sparse stage kernel: the torch stages under their own name."""
from .torch_stages import SparseTorch


class SparseTorch2(SparseTorch):
    name = "torch2"
''',
}
# (file, the line the import goes above, the import, the entry closing ``_REGISTERED``)
REGISTRATIONS = [
    ("mindspeed_laga/kernels/registry.py", "from .declared.npu import Npu\n",
     "from .declared.sdpa2 import Sdpa2\n", "Sdpa2"),
    ("mindspeed_laga/cp_algos/__init__.py", "from .hybrid import Hybrid\n",
     "from .kvgather import KvGather, KvGatherOwn\n", "KvGather(), KvGatherOwn()"),
]
NEW_RELEASE, SAME_AS = "26.1.1", "26.1.0"
RELEASE_ROW = (f'    Release("{NEW_RELEASE}", "0a1b2c3d", "{NEW_RELEASE}_core_r0.12.1", "4e5f6a7b", '
               f'"9.1.0", "{NEW_RELEASE}", same_as="{SAME_AS}"),\n')
SPARSE_ANCHOR = "KERNEL_TYPES: Sequence[Type[SparseKernel]] = ("
NEW = ("sdpa2", "kvgather", "kvgather_own", NEW_RELEASE, "torch2")

# What runs in the copy, in one process: the copy is what runs; the commands with the new
# entries (the old alias still the old kernel's); the tests' axes hold them.
PROBE = '''
import contextlib, io, sys
copy, new = sys.argv[1], sys.argv[2:]
import mindspeed_laga.patches.mindspeed_llm.releases as releases
from mindspeed_laga.cp_algos import ALGOS
from mindspeed_laga.kernels import registry
from mindspeed_laga.tools import cli
from support import variants
assert all(m.__file__.startswith(copy) for m in (releases, registry, cli)), releases.__file__
from mindspeed_laga.sparse.registry import SPARSE_KERNELS
assert set(new) <= set(releases.BY_NAME) | set(registry.KERNEL_NAMES) | set(ALGOS) | set(SPARSE_KERNELS)


def run(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(list(argv))
    assert code == 0, (argv, out.getvalue()[-3000:])
    return out.getvalue()


small = ("--cp", "4", "--seq-len", "4096")
plans = [run("plan", "--kernel", "sdpa2", "--cp-algo", "kvgather", *small),
         run("plan", "--kernel", "both", "--cp-algo", "kvgather_own", *small),
         run("plan", *small)]
assert "cp_algo=kvgather " in plans[0] and "saved sdpa2" in plans[0], plans[0]
assert "--context-parallel-algo kvallgather_cp_algo" in plans[0], plans[0]
assert "cp_algo=kvgather_own " in plans[1] and "kvgather" in plans[2], plans[1:]
assert all(len(line) <= 100 for plan in plans for line in plan.splitlines())
assert run("plan", "--kernel", "fused", *small) == run("plan", "--kernel", "sdpa", *small)
tiny = ("--cp", "2", "--seq-len", "32", "--heads", "2", "--repeat", "1")
for algo, kernel in (("kvgather", "sdpa2"), ("kvgather_own", "sdpa")):
    out = run("verify", *tiny, "--kernel", kernel, "--cp-algo", algo)
    assert "OK: every form matches the reference" in out and out.count(algo) >= 3, out
out = run("bench", "--cp", "2", "--seq-lens", "32", "--heads", "2", "--repeat", "1", "--warmup",
          "0", "--forms-only", "--kernel", "sdpa2", "--cp-algo", "kvgather_own", "--json", "",
          "--plot", "")
assert "kvgather_own" in out, out
out = run("bench", "--dsa", "deepseek-v3.2", "--cp", "2", "--seq-lens", "32", "--heads", "2",
          "--repeat", "1", "--warmup", "0", "--index-topk", "8", "--json", "")
# a row per layer kind: the kind, then S
assert "top-k 8" in out and any(line.split()[:2] == ["computing", "32"]
                                for line in out.splitlines()), out
# the new sparse kernel at every stage, the all_keys target its loss declares included
import torch
from support import sparse_kernels
assert any("torch2" in combo for combo in sparse_kernels.EXACT)
# the equivalence axes: the tables' algorithms at every CP size, the others from CP 4 on
assert "sdpa2" in variants.CPU_KERNELS and "kvgather" in variants.algos_for(2)
assert "kvgather_own" in variants.algos_for(4) and "kvgather_own" not in variants.algos_for(2)
print("probe done")
'''
# The test modules that read each registry, unedited (only their cases that can meet a new
# entry where the whole module would take minutes), in one pytest run.
TESTS = ["tests/tools/test_kernel_declarations.py", "tests/tools/test_plan_cli.py",
         "tests/tools/test_no_silent_ignores.py::test_help_does_not_import_torch",
         "tests/tools/test_plan_recommendation.py", "tests/mindspeed/test_mindspeed_llm_releases.py",
         "tests/core/test_sparse_package.py", "tests/core/test_sparse_kernels.py",
         "-k", "test_kernel_declarations or help or test_mindspeed_llm_releases "
               "or test_sparse_package or host or honours or 100 or alias or node_table "
               "or (test_sparse_kernels and not combination) "
               "or cp2-zigzag-torch2-torch2-torch2"]
# the loop modules build a case per release row: collected, the new release's among them
LOOP_MODULES = ["tests/loop/test_real_loop.py", "tests/loop/test_real_tune.py"]


def _register(path: Path, anchor: str, import_line: str, entry: str) -> None:
    """The registration: ``import_line`` above ``anchor`` and ``entry`` as the tuple's last."""
    text = path.read_text()
    assert text.count(anchor) == 1, (path, anchor)
    text = text.replace(anchor, import_line + anchor)
    head, tail = text.split("_REGISTERED = (", 1)
    body, rest = tail.split("\n)\n", 1)
    path.write_text(f"{head}_REGISTERED = ({body}\n    {entry},\n){chr(10)}{rest}")


def _add_release_row(path: Path) -> None:
    """The row, last in ``ROWS``."""
    text = path.read_text()
    head, tail = text.split("\nROWS = (\n", 1)
    body, rest = tail.split("\n)\n", 1)
    path.write_text(f"{head}\nROWS = (\n{body}\n{RELEASE_ROW})\n{rest}")


def _add_sparse_kernel(path: Path) -> None:
    """Its import and its class last in ``KERNEL_TYPES``."""
    text = path.read_text()
    head, tail = text.split(SPARSE_ANCHOR, 1)
    body, rest = tail.split(")\n", 1)
    head = head.replace("from .torch_stages import SparseTorch\n",
                        "from .torch_stages import SparseTorch\nfrom .torch2_stages import SparseTorch2\n")
    path.write_text(f"{head}{SPARSE_ANCHOR}{body}, SparseTorch2)\n{rest}")


def _copy(tmp_path: Path) -> Path:
    """The repository copied, the additions made; the installed package's mapping of
    ``features/`` and ``patches/`` under ``mindspeed_laga`` made by links in the copy."""
    copy = tmp_path / "repo"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", "*.egg-info", ".pytest_cache", "bench_out"))
    for folder in ("features", "patches"):
        (copy / "mindspeed_laga" / folder).symlink_to(copy / folder, target_is_directory=True)
    for path, text in FILES.items():
        (copy / path).write_text(text)
    for path, *registration in REGISTRATIONS:
        _register(copy / path, *registration)
    _add_release_row(copy / "patches" / "mindspeed_llm" / "releases.py")
    _add_sparse_kernel(copy / "mindspeed_laga" / "sparse" / "registry.py")
    return copy


def _archives(tmp_path: Path) -> Path:
    """The tests' archive folder with the new release's archives: 26.1.0's, renamed."""
    from mindspeed_laga.patches.mindspeed_llm.releases import BY_NAME, Release
    folder = tmp_path / "thirdparty"
    folder.mkdir()
    source = thirdparty.archive_dir()
    if source.is_dir():
        for archive in source.iterdir():
            (folder / archive.name).symlink_to(archive.resolve())
    new = Release(NEW_RELEASE, "0a1b2c3d", f"{NEW_RELEASE}_core_r0.12.1", "4e5f6a7b", None, None)
    for mine, theirs in zip(new.archives(), BY_NAME[SAME_AS].archives()):
        if (source / theirs).is_file():
            (folder / mine).symlink_to((source / theirs).resolve())
    return folder


def _run(copy: Path, env: dict, *argv, timeout=300) -> str:
    proc = subprocess.run([sys.executable, *argv], cwd=copy, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{argv}:\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.timeout(900)
def test_the_extension_points_take_each_addition_as_documented(tmp_path):
    copy = _copy(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(copy), str(copy / "tests")]),
               LAGA_THIRDPARTY=str(_archives(tmp_path)))
    env.pop("PYTEST_ADDOPTS", None)
    assert "probe done" in _run(copy, env, "-c", PROBE, str(copy), *NEW)
    out = _run(copy, env, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS, timeout=600)
    assert " passed" in out and " failed" not in out, out[-3000:]
    collected = _run(copy, env, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                     *LOOP_MODULES)
    assert f"[{NEW_RELEASE}]" in collected, collected[-3000:]


# ------------------------------------------------- an agreement field, added as documented

FIELD_WORKER = '''
import sys
import torch
from mindspeed_laga import laga_attention
from mindspeed_laga.tools.spawn import run_on_ranks


def worker(rank, world):
    import torch.distributed as dist
    g = torch.Generator().manual_seed(0)
    q, kv, kpe = (torch.randn(8, 1, *shape, generator=g, dtype=torch.float64)
                  for shape in ((2, 12), (16,), (4,)))
    w = torch.randn(2 * 16, 16, generator=g, dtype=torch.float64)
    try:
        laga_attention(q, kv, kpe, w, softmax_scale=0.3, cp_group=dist.group.WORLD,
                       layout="contiguous", pad_v=bool(rank))
        return None
    except ValueError as exc:
        return str(exc)


if __name__ == "__main__":
    print("messages:", run_on_ranks(worker, 2, timeout_s=120))
'''


@pytest.mark.timeout(300)
def test_agreement_field_extension(tmp_path):
    """A field added as DESIGN.md's "Extension points" says (one ``Field`` row in
    ``agreement/fields.py``, one line in the row builder ``agreement/rows.py``), in a copy
    of the package: two ranks that differ on it raise, naming it, on every rank."""
    import mindspeed_laga as package
    source = Path(package.__file__).resolve().parent
    copy = tmp_path / "mindspeed_laga"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
    fields, rows = copy / "agreement" / "fields.py", copy / "agreement" / "rows.py"
    anchor = '    Field("calls"),'
    assert fields.read_text().count(anchor) == 1
    fields.write_text(fields.read_text().replace(
        anchor, '    Field("pad_v", "pad_v (V zero-padded for the NPU op)", bool),\n' + anchor))
    builder = '              "kernel": choice_code(KERNELS, o.kernel),\n'
    assert rows.read_text().count(builder) == 1
    line = '              "pad_v": int(o.pad_v),\n'
    rows.write_text(rows.read_text().replace(builder, builder + line))
    script = tmp_path / "field_worker.py"
    script.write_text(FIELD_WORKER)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("CP ranks disagree on pad_v (V zero-padded for the NPU op): "
                             "[False, True]") == 2, proc.stdout[-3000:]

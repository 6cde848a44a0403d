"""docs/DESIGN.md's "Extension points", done as its table says in a copy of the whole
repository, one addition per point:

- a dense kernel ``tiled``: a new class (not a subclass), one file in ``kernels/declared/``
  and its registration; it runs the eager kernel's math through its own methods;
- a CP algorithm ``kvgather`` with no host counterpart (``host_algo = ""``), in the tables,
  and ``kvgather_own`` outside them, one file and its registration;
- a release ``2.3.1`` identical to 2.3.0 under a new name (one row, ``same_as``; its
  archives in the tests' archive folder, 2.3.0's under 2.3.1's names);
- a sparse stage kernel ``torch2``: a new class on the shared torch math, selected through
  its own host flag (one file and its registration);
- a model preset (one ``Preset`` line in ``MODELS``, ``tools/costmodel/presets.py``);
- an agreement field (its own test below, :func:`test_agreement_field_extension`).

Then ``plan``, ``verify``, ``bench`` and ``bench --dsa`` run there with the new entries,
and every test module that reads a registry runs there, unedited and unfiltered (``-m``
as the leg that runs this test: the real-host matrix, ``hosts``, runs in the Ascend leg,
where :func:`test_the_new_release_runs_the_real_module` runs the new release's real-module
cases). A tool or test that keeps its own list of names (a second name table, a literal
kernel or release list, a module-level assert on the rows) fails here: the new entry is
missing from it, or breaks it. The new entries run the code of the ones they are built
on, so every comparison they meet holds.
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
    "mindspeed_laga/kernels/declared/tiled.py": '''"""A new kernel: its own class, the eager math."""
from ..base import Kernel


class Tiled(Kernel):
    name = "tiled"
    block_note = "eager math, its own name"

    @classmethod
    def model_kind(cls, device_type):
        return "eager"

    def attend_segment(self, q, k, v, *, scale, causal, pieces=None, keep=None):
        from .. import eager
        return eager.attend_segment(q, k, v, scale=scale, causal=causal, pieces=pieces, keep=keep)

    @property
    def block(self):
        from ..eager import EagerBlock
        return EagerBlock
''',
    "mindspeed_laga/cp_algos/kvgather.py": '''"""New CP algorithms with no host counterpart: allgather under other names, in the
tables and outside them."""
from .allgather import AllGather


class KvGather(AllGather):
    name = "kvgather"
    host_algo = ""


class KvGatherOwn(AllGather):
    name = "kvgather_own"
    host_algo = ""
    in_tables = False
''',
    "mindspeed_laga/sparse/torch2_stages.py": '''"""A new sparse stage kernel: the torch math under its own name and host flag."""
import torch
import torch.distributed as dist

from .absorbed import absorbed_scores, picked_output, softmax_stats
from .indexer import KL_EPS, attention_target, indexer_loss
from .stage import Attended, LossReads, SparseKernel
from .topk_scores import indexer_topk


class SparseTorch2(SparseKernel):
    name = "torch2"
    loss_reads = LossReads.PROBS
    kl_eps = KL_EPS
    host_flags = {"attention": "use_torch2_sparse_attn"}

    def topk(self, call, index_query, index_weights, index_topk):
        return indexer_topk(index_query, call.index_key, index_weights, call.query_pos,
                            index_topk, call.query_start)

    def attend(self, call, query, kv_up_weight, picks, keep):
        q_latent, scores, latent = absorbed_scores(call, query, kv_up_weight, picks.indices)
        probs = torch.softmax(scores, dim=-1)
        output = picked_output(call, probs, latent, kv_up_weight, query.shape)
        stats = (softmax_stats(q_latent, query, call.qk_head_dim, scores)
                 if keep is LossReads.STATS else None)
        return Attended(output, probs.detach() if keep is LossReads.PROBS else None, stats)

    def loss(self, call, attended, picks, index_query, index_weights, coeff, tp_group):
        target = attention_target(attended.probs)
        if tp_group is not None:
            dist.all_reduce(target, group=tp_group)
        return indexer_loss(target, picks.scores, picks.indices >= 0, coeff)
''',
}
# (file, the line the import goes above, the import, the entry closing ``_REGISTERED``)
REGISTRATIONS = [
    ("mindspeed_laga/kernels/registry.py", "from .declared.npu import Npu\n",
     "from .declared.tiled import Tiled\n", "Tiled"),
    ("mindspeed_laga/cp_algos/__init__.py", "from .hybrid import Hybrid\n",
     "from .kvgather import KvGather, KvGatherOwn\n", "KvGather(), KvGatherOwn()"),
    ("mindspeed_laga/sparse/registry.py", "from .torch_stages import SparseTorch\n",
     "from .torch2_stages import SparseTorch2\n", "SparseTorch2"),
]
NEW_RELEASE, SAME_AS = "2.3.1", "2.3.0"
RELEASE_ROW = (f'    Release("{NEW_RELEASE}", "0a1b2c3d", "{NEW_RELEASE}_core_r0.12.1", "4e5f6a7b", '
               f'"8.5.0", "7.3.0", same_as="{SAME_AS}"),\n')
# the preset registry: one ``Preset`` line in ``MODELS`` (no recipe, saying why)
PRESETS = "mindspeed_laga/tools/costmodel/presets.py"
PRESET_ANCHOR = "MODELS: Dict[str, Preset] = {\n"
NEW_PRESET = "mla-trial"
PRESET_LINE = (f'    "{NEW_PRESET}": Preset(ModelDims(32, 128, 64, 128, 512, 4096, 1024), None,\n'
               '                       no_recipe="a trial model: no host recipe"),\n')
NEW = ("tiled", "kvgather", "kvgather_own", NEW_RELEASE, "torch2")

# What runs in the copy, in one process: the copy is what runs; the commands with the new
# entries; the host flag selects the new sparse kernel; the tests' axes hold them.
PROBE = '''
import contextlib, io, sys
from argparse import Namespace
from types import SimpleNamespace
copy, preset, new = sys.argv[1], sys.argv[2], sys.argv[3:]
import mindspeed_laga.patches.mindspeed_llm.releases as releases
from mindspeed_laga.cp_algos import ALGOS
from mindspeed_laga.features.laga_args import CP_ALGO_MAP
from mindspeed_laga.kernels import registry
from mindspeed_laga.sparse.registry import SPARSE_KERNELS
from mindspeed_laga.tools import cli
from support import variants
assert all(m.__file__.startswith(copy) for m in (releases, registry, cli)), releases.__file__
registered = set(releases.BY_NAME) | set(registry.KERNEL_NAMES) | set(ALGOS) | set(SPARSE_KERNELS)
assert set(new) <= registered


def run(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(list(argv))
    assert code == 0, (argv, out.getvalue()[-3000:])
    return out.getvalue()


small = ("--cp", "4", "--seq-len", "4096")
plans = [run("plan", "--kernel", "tiled", "--cp-algo", "kvgather", *small),
         run("plan", "--kernel", "both", "--cp-algo", "kvgather_own", *small),
         run("plan", *small)]
assert "cp_algo=kvgather " in plans[0] and "tiled" in plans[0], plans[0]
# no host counterpart: plan names no --context-parallel-algo for it, and nothing maps to it
assert "no MindSpeed --context-parallel-algo runs kvgather" in plans[0], plans[0]
assert "" not in CP_ALGO_MAP
assert not {"kvgather", "kvgather_own"} & {algo for algo, _ in CP_ALGO_MAP.values()}
assert "cp_algo=kvgather_own " in plans[1] and "kvgather" in plans[2], plans[1:]
assert all(len(line) <= 100 for plan in plans for line in plan.splitlines())
if preset:
    assert "mla-trial" in run("plan", "--preset", preset, *small)
tiny = ("--cp", "2", "--seq-len", "32", "--heads", "2", "--repeat", "1")
for algo, kernel in (("kvgather", "tiled"), ("kvgather_own", "sdpa")):
    out = run("verify", *tiny, "--kernel", kernel, "--cp-algo", algo)
    assert "OK: every form matches the reference" in out and out.count(algo) >= 3, out
out = run("bench", "--cp", "2", "--seq-lens", "32", "--heads", "2", "--repeat", "1", "--warmup",
          "0", "--forms-only", "--kernel", "tiled", "--cp-algo", "kvgather_own", "--json", "",
          "--plot", "")
assert "kvgather_own" in out, out
out = run("bench", "--dsa", "deepseek-v3.2", "--cp", "2", "--seq-lens", "32", "--heads", "2",
          "--repeat", "1", "--warmup", "0", "--index-topk", "8", "--json", "")
assert "top-k 8" in out and any(line.split()[:2] == ["computing", "32"]
                                for line in out.splitlines()), out
# the new sparse kernel: selected by its host flag through the adapter, at every stage of
# the kernel tests' combinations
from megatron.core import parallel_state
parallel_state.get_tensor_model_parallel_world_size = lambda: 1
from mindspeed_laga.patches.mindspeed_llm.dsa import dsa_kernels
module = SimpleNamespace(enable_mla_absorb=True)
assert dsa_kernels(module, Namespace(use_torch2_sparse_attn=True))["attention_kernel"] == "torch2"
assert dsa_kernels(module, Namespace())["attention_kernel"] == "torch"
from support import sparse_kernels
assert any("torch2" in combo for combo in sparse_kernels.EXACT)
# the new release: 2.3.0's facts, so 2.3.0's sources are it; its archives are found
same = releases.BY_NAME[new[3]]
assert same.facts() == releases.BY_NAME[same.same_as].facts() and same.same_as
from support import thirdparty
assert new[3] in thirdparty.RELEASE_NAMES
# the equivalence axes: the tables' algorithms at every CP size, the others from CP 4 on
assert "tiled" in variants.CPU_KERNELS and "kvgather" in variants.algos_for(2)
assert "kvgather_own" in variants.algos_for(4) and "kvgather_own" not in variants.algos_for(2)
print("probe done")
'''
# Every test module that reads a registry, unedited and unfiltered, in one pytest run.
TESTS = ["tests/tools/test_kernel_declarations.py", "tests/tools/test_plan_cli.py",
         "tests/tools/test_no_silent_ignores.py", "tests/tools/test_plan_recommendation.py",
         "tests/tools/test_bench_cli.py", "tests/mindspeed/test_mindspeed_llm_releases.py",
         "tests/mindspeed/test_mindspeed_llm_patch.py", "tests/mindspeed/test_feature.py",
         "tests/mindspeed/test_script_bad_values.py",
         "tests/core/test_sparse_package.py", "tests/core/test_sparse_kernels.py",
         "tests/core/test_sparse_host_flags.py", "tests/core/test_import_graph.py"]
PRESET_TESTS = ["tests/tools/test_plan_presets.py"]
# the loop modules build a case per release row: collected, the new release's among them
LOOP_MODULES = ["tests/loop/test_real_loop.py", "tests/loop/test_real_tune.py"]
# the new release's real-module cases (the Ascend leg's ``hosts`` matrix)
REAL_MODULE_CASES = [
    f"tests/mindspeed/{module}::{case}[{NEW_RELEASE}]" for module, case in (
        ("test_mindspeed_llm_patch.py", "test_real_custom_mla_self_attention"),
        ("test_lora_real.py", "test_startup_refusals_through_each_releases_parser"))]


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


def _add_preset(path: Path) -> None:
    """The line, first in ``MODELS``."""
    text = path.read_text()
    assert text.count(PRESET_ANCHOR) == 1, path
    path.write_text(text.replace(PRESET_ANCHOR, PRESET_ANCHOR + PRESET_LINE))


def _copy(tmp_path: Path):
    """The repository copied, the additions made; the installed package's mapping of
    ``features/`` and ``patches/`` under ``mindspeed_laga`` made by links in the copy.
    Returns the copy."""
    copy = tmp_path / "repo"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "__pycache__", "*.egg-info", ".pytest_cache", "bench_out"))
    for folder in ("features", "patches"):
        (copy / "mindspeed_laga" / folder).symlink_to(copy / folder, target_is_directory=True)
    for path, text in FILES.items():
        (copy / path).write_text(text)
    for path, *registration in REGISTRATIONS:
        _register(copy / path, *registration)
    _add_release_row(copy / "patches" / "mindspeed_llm" / "releases.py")
    _add_preset(copy / PRESETS)
    return copy


def _archives(tmp_path: Path) -> Path:
    """The tests' archive folder with the new release's archives: 2.3.0's, renamed."""
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


def _env(copy: Path, tmp_path: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(copy), str(copy / "tests")]),
               LAGA_THIRDPARTY=str(_archives(tmp_path)))
    env.pop("PYTEST_ADDOPTS", None)
    return env


@pytest.mark.timeout(1500)
def test_the_extension_points_take_each_addition_as_documented(tmp_path):
    copy = _copy(tmp_path)
    env = _env(copy, tmp_path)
    assert "probe done" in _run(copy, env, "-c", PROBE, str(copy), NEW_PRESET, *NEW)
    tests = TESTS + PRESET_TESTS
    out = _run(copy, env, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not hosts",
               "--durations=12", *tests, timeout=1200)
    print(out[-3000:])  # the durations of the registry-reading modules
    assert " passed" in out and " failed" not in out, out[-3000:]
    collected = _run(copy, env, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                     *LOOP_MODULES)
    assert f"[{NEW_RELEASE}]" in collected, collected[-3000:]


@pytest.mark.ascend
@pytest.mark.hosts
@pytest.mark.timeout(900)
def test_the_new_release_runs_the_real_module(tmp_path):
    """The release identical to 2.3.0: the real-module cases accept it on 2.3.0's sources
    (the host shows 2.3.0's facts, which are the new release's)."""
    thirdparty.release_sources(SAME_AS)  # skips (fails under CI) without the archives
    copy = _copy(tmp_path)
    out = _run(copy, _env(copy, tmp_path), "-m", "pytest", "-q", "-p", "no:cacheprovider",
               *REAL_MODULE_CASES, timeout=850)
    assert "2 passed" in out, out[-3000:]



# --- an agreement field, added as documented -----------------------------------------------

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

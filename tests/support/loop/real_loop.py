"""Run MindSpeed-LLM's unmodified ``pretrain_gpt.py`` on gloo CPU ranks, as a user would.

    torchrun --nproc-per-node N -m mindspeed_laga.launch pretrain_gpt.py <recipe flags>

What a CPU machine needs for that, and nothing in the host sources changes:

- a writable copy of Megatron-LM (its dataset helper is compiled with pybind11 into
  the source tree on first use; the copy is made once per archive and Python under
  the test cache, with the helper built there);
- a small Megatron indexed dataset written with Megatron's own
  ``IndexedDatasetBuilder``: EOD-terminated documents of random tokens (built once per
  Megatron source and kept in the test cache, copied for every loop module);
- tests/support/loop/bootstrap first on PYTHONPATH: its ``sitecustomize`` installs the CPU
  stand-ins (tests/support/npu_host.py) in every rank and records, per rank, the
  losses and grad norm of each iteration at full precision and how often LAGA, the MLA
  module and the host's core attention ran (``rank<R>.json``).

The recipe is the stock DeepSeek-V3 pretrain script
(``examples/mcore/deepseek3/pretrain_deepseek3_671b_4k_ptd.sh``), its flags read by
running the script with ``python`` replaced by a printer, then scaled down: dimensions
shrunk, NPU-only fusions switched off by their flags, one node of gloo CPU ranks,
fp32, a few iterations at a learning rate that moves the losses. MLA with q-lora,
qk-layernorm and yarn rope, MoE with a shared expert and the sigmoid group-top-k
router, and MTP stay as the script has them.

``python tests/support/loop/real_loop.py [--release 26.1.0] --cp 2 --algo ulysses_cp_algo [--laga]
[--documents]`` runs one case and prints its losses (the host sources of that release pair
come from tests/support/thirdparty.py).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

TESTS = Path(__file__).resolve().parents[2]
BOOTSTRAP = Path(__file__).resolve().parent / "bootstrap"
LAGA = "--mla-latent-all-gather"

SEQ_LENGTH = 64
VOCAB = 256  # NullTokenizer: ids 0..VOCAB-1, EOD = VOCAB
ITERATIONS = 4
MICRO_BATCHES = 2  # per iteration (global batch 2, micro-batch 1, DP 1)

# flag -> value: the stock recipe's dimensions and parallel sizes, shrunk
SCALED = {
    "--num-layers": "2", "--first-k-dense-replace": "1",  # one dense layer, one MoE layer
    "--hidden-size": "64", "--ffn-hidden-size": "128", "--num-attention-heads": "4",
    "--seq-length": str(SEQ_LENGTH), "--max-position-embeddings": str(SEQ_LENGTH),
    "--q-lora-rank": "32", "--kv-lora-rank": "32", "--qk-head-dim": "16",
    "--qk-pos-emb-head-dim": "8", "--v-head-dim": "16",
    "--num-experts": "4", "--moe-router-topk": "2", "--moe-ffn-hidden-size": "32",
    "--moe-router-num-groups": "2", "--moe-router-group-topk": "1",
    "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "1",
    "--expert-model-parallel-size": "1",
    "--micro-batch-size": "1", "--global-batch-size": str(MICRO_BATCHES),
    "--vocab-size": str(VOCAB), "--padded-vocab-size": str(VOCAB + 1),
    "--tokenizer-type": "NullTokenizer",
    "--train-iters": str(ITERATIONS), "--lr": "3e-3", "--min-lr": "3e-4",
    "--lr-warmup-iters": "0", "--distributed-timeout-minutes": "10",
}
# flags dropped from the stock recipe, and why
DROPPED = {
    # NPU-only fusions and kernels (each has no CPU path)
    "--gemm-gradient-accumulation-fusion", "--use-fused-rotary-pos-emb", "--use-fused-swiglu",
    "--use-fused-rmsnorm", "--moe-grouped-gemm", "--moe-permute-fusion", "--use-ascend-coc",
    "--coc-fused-kernel", "--swap-optimizer", "--swap-optimizer-times",
    # MindSpeed rejects dualpipev with CP; --moe-fb-overlap needs it (or a virtual pipeline)
    "--schedules-method", "--moe-fb-overlap",
    # bf16 on CPU would hide small differences under its rounding: the test runs fp32
    "--bf16", "--initial-loss-scale",
    # two layers, no pipeline: no noop layers; a HF tokenizer/checkpoint is not needed
    "--noop-layers", "--tokenizer-name-or-path", "--enable-hf2mg-convert", "--model-type-hf",
    "--save", "--load",
    # per-case choices (see recipe()): documents, recompute, the host's CP-local router terms
    "--reset-attention-mask", "--recompute-method", "--recompute-granularity",
    "--recompute-num-layers", "--seq-aux", "--moe-router-enable-expert-bias",
    # the CPU ranks' own settings replace these
    "--distributed-backend", "--context-parallel-size", "--context-parallel-algo",
    "--data-path",
}
CPU_FLAGS = ["--distributed-backend", "gloo", "--use-cpu-initialization",
             "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
             "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-bias-swiglu-fusion"]
# MindSpeed-LLM's --seq-aux and --moe-router-enable-expert-bias compute the router's
# balance terms on the CP-local shard of the sequence, so the host itself trains a
# different model at CP=2 than at CP=1 (LAGA on or off): the CP comparisons leave
# them out (docs/INTEGRATION.md, "The real training loop")
HOST_CP_VARIANT = ["--seq-aux", "--moe-router-enable-expert-bias"]


# --- the recipe -----------------------------------------------------------------------------

def stock_flags(llm_src: Path) -> List[str]:
    """The arguments the stock DeepSeek-V3 script hands to pretrain_gpt.py, as shipped."""
    from support.recipes import RECIPE_DIR, RECIPES, recipe_argv
    return recipe_argv(Path(llm_src) / RECIPE_DIR / RECIPES[0], dummies=Path("/placeholder"))[0]


def flag_groups(argv: List[str]):
    """[(flag, [values])] in order; a value never starts with '--'."""
    groups = []
    for token in argv:
        if token.startswith("--"):
            groups.append((token, []))
        else:
            groups[-1][1].append(token)
    return groups


def recipe(llm_src: Path, cp_size: int, cp_algo: str, laga: bool, data_path: str,
           documents: bool = False, recompute: bool = False, ulysses_degree: Optional[int] = None,
           extra: List[str] = (), without: Sequence[str] = (),
           layout: Optional[Dict[str, str]] = None, stock: Optional[List[str]] = None,
           scaled: Optional[Dict[str, str]] = None) -> List[str]:
    """pretrain_gpt.py's arguments for one case: the stock recipe scaled down;
    ``without``: stock flags this case leaves out (with their values); ``layout``: flag ->
    value replacing a stock flag's (scaled) value, e.g. the parallel sizes, the global batch
    or the iterations (flags the stock recipe lacks go in ``extra``); ``stock`` and
    ``scaled``: another recipe's flags and their shrunk values (default: DeepSeek-V3's)."""
    layout = dict(layout or {})
    scaled = SCALED if scaled is None else scaled
    argv = []
    stock = flag_groups(stock_flags(llm_src) if stock is None else stock)
    stock_names = {flag for flag, _ in stock}
    missing = [flag for flag in [*scaled, *layout] if flag not in stock_names]
    if missing:  # the stock script changed: the scaling no longer describes it
        raise RuntimeError(f"the stock recipe lacks {missing}")
    for flag, values in stock:
        if flag in DROPPED or flag in without:
            continue
        value = layout.get(flag, scaled.get(flag))
        argv += [flag] + ([value] if value is not None else values)
    argv += CPU_FLAGS + ["--data-path", data_path, "--context-parallel-size", str(cp_size),
                         "--context-parallel-algo", cp_algo]
    if ulysses_degree:
        argv += ["--ulysses-degree-in-cp", str(ulysses_degree)]
    if documents:
        argv += ["--reset-attention-mask"]
    if recompute:  # the stock recipe's recompute settings
        argv += ["--recompute-method", "uniform", "--recompute-granularity", "full",
                 "--recompute-num-layers", "1"]
    if laga:
        argv += [LAGA]
    return argv + list(extra)


def flag_value(argv: Sequence[str], flag: str, default: Optional[str] = None) -> Optional[str]:
    """The value the host reads for ``flag`` (argparse keeps the last one)."""
    positions = [i for i, token in enumerate(argv) if token == flag]
    return argv[positions[-1] + 1] if positions else default


def ranks(argv: Sequence[str], dp: int = 1) -> int:
    """The processes a recipe needs for data-parallel size ``dp``: Megatron derives DP as
    world / (TP x PP x CP); expert parallelism is carved out of DP x CP (x TP)."""
    sizes = [int(flag_value(argv, f"--{name}-parallel-size", "1"))
             for name in ("tensor-model", "pipeline-model", "context")]
    return sizes[0] * sizes[1] * sizes[2] * dp


# --- sources and data -----------------------------------------------------------------------

def writable_megatron(megatron_src: Path) -> Path:
    """A copy of Megatron-LM with its dataset helper built, once per source and Python."""
    from support.thirdparty import cache_dir

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    key = hashlib.sha256(f"{Path(megatron_src).resolve()}|{suffix}".encode()).hexdigest()[:16]

    def build(staging: Path):
        copy = staging / "Megatron-LM"
        shutil.copytree(megatron_src, copy, symlinks=False)
        datasets = copy / "megatron" / "core" / "datasets"
        includes = subprocess.run([sys.executable, "-m", "pybind11", "--includes"], check=True,
                                  capture_output=True, text=True).stdout.split()
        subprocess.run([os.environ.get("CXX", "g++"), "-O3", "-Wall", "-shared", "-std=c++11",
                        "-fPIC", *includes, "helpers.cpp", "-o", f"helpers_cpp{suffix}"],
                       cwd=datasets, check=True, capture_output=True, timeout=300)
        (copy / ".helper-built").touch()

    target = cache_dir().parent / "loop" / f"megatron-{key}"
    return _built_once(target, Path("Megatron-LM") / ".helper-built", build) / "Megatron-LM"


def _built_once(target: Path, done: Path, build) -> Path:
    """``target`` in the test cache: unless ``target / done`` exists, ``build(staging)``
    fills a fresh folder that is then renamed to ``target`` (atomic: of concurrent runs the
    first wins)."""
    if (target / done).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        build(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / done).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_dataset(megatron_src: Path, prefix: Path, documents: List[int], seed: int = 1234):
    """An indexed dataset of EOD-terminated documents (lengths include the EOD) of random
    tokens, written by Megatron's own IndexedDatasetBuilder (in a subprocess, so the host's
    Megatron is the one imported)."""
    code = (
        "import sys, torch, numpy\n"
        "from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, "
        "get_bin_path, get_idx_path\n"
        "prefix, vocab, seed, lengths = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), "
        "[int(x) for x in sys.argv[4:]]\n"
        "g = torch.Generator().manual_seed(seed)\n"
        "builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.int32)\n"
        "for n in lengths:\n"
        "    doc = torch.randint(0, vocab, (n - 1,), generator=g).tolist() + [vocab]\n"
        "    builder.add_document(numpy.array(doc, dtype=numpy.int32), [n])\n"
        "builder.finalize(get_idx_path(prefix))\n")
    env = dict(os.environ, PYTHONPATH=str(megatron_src))
    subprocess.run([sys.executable, "-c", code, str(prefix), str(VOCAB), str(seed),
                    *map(str, documents)], check=True, env=env, capture_output=True, timeout=300)


# --- running --------------------------------------------------------------------------------

@dataclass
class LoopRun:
    """One run's outcome: per-iteration losses and grad norms (full precision, from the
    host's training_log), the printed log, and each rank's counters."""
    argv: List[str]
    log: str
    iterations: Dict[int, dict]
    counts: List[dict]
    printed: Dict[int, dict] = field(default_factory=dict)
    seconds: float = 0.0
    # per rank, per region (iteration, MLA call, backward): what LAGA ran (bootstrap)
    steady: List[dict] = field(default_factory=list)

    def series(self, key: str) -> List[float]:
        return [self.iterations[i]["losses"][key] if key != "grad norm"
                else self.iterations[i]["grad_norm"] for i in sorted(self.iterations)]


class LoopFailed(RuntimeError):
    """The run did not finish; ``log`` is everything it printed (a start-up refusal's text)."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


# what pretrain_gpt.py needs besides the host sources' own modules (tests/support/thirdparty.py):
# import name -> the pin of MindSpeed-LLM c77308a1's requirements.txt
LOOP_MODULES = {"transformers": "transformers==5.2.0", "pybind11": "pybind11"}


def missing_modules() -> List[str]:
    import importlib.util
    return [pin for name, pin in LOOP_MODULES.items() if importlib.util.find_spec(name) is None]


def python_shims(workdir: Path) -> Path:
    """A folder of ``python3`` and ``python3-config`` for this interpreter: Megatron's
    dataset-helper Makefile asks them for pybind11 and the extension suffix (the helper is
    already built under that name, so make finds it up to date)."""
    shims = workdir / "shims"
    shims.mkdir(exist_ok=True)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    scripts = {"python3": f'#!/bin/sh\nexec "{sys.executable}" "$@"\n',
               "python3-config": f'#!/bin/sh\n[ "$1" = --extension-suffix ] && echo "{suffix}" '
                                 f'&& exit 0\nexit 1\n'}
    for name, text in scripts.items():
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    return shims


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# torchrun polls its ranks every 0.1 s and stops the others as soon as one has exited: a
# run that must show every rank's refusal polls this seldom instead, so a rank that is a
# few seconds behind on a loaded machine still reaches its own refusal before it is stopped
EVERY_RANK_MONITOR_S = 15.0


def run_loop(sources: dict, workdir: Path, nproc: int, argv: List[str],
             timeout_s: float = 600, script: str = "pretrain_gpt.py",
             extra_env: Optional[Dict[str, str]] = None,
             every_rank_exits: bool = False) -> LoopRun:
    """torchrun ... -m mindspeed_laga.launch pretrain_gpt.py argv, on gloo CPU ranks
    (``script``: another entry point of the host, e.g. posttrain_gpt.py; ``extra_env``:
    more environment for the ranks; ``every_rank_exits``: a run expected to stop at
    start-up on every rank, whose log must hold each rank's own message)."""
    workdir.mkdir(parents=True, exist_ok=True)
    record = workdir / "record"
    shutil.rmtree(record, ignore_errors=True)
    record.mkdir()
    llm = Path(sources["MINDSPEED_LLM_SRC"])
    path = [str(BOOTSTRAP), str(llm), sources["MINDSPEED_SRC"], sources["MEGATRON_SRC"]]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), LAGA_LOOP_RECORD=str(record),
               PATH=os.pathsep.join([str(python_shims(workdir)), os.environ.get("PATH", "")]),
               LAGA_LOOP_TESTS=str(TESTS), CUDA_DEVICE_MAX_CONNECTIONS="1",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra_env or {})
    if every_rank_exits:  # torchrun reads each of its options from PET_<OPTION> too
        env["PET_MONITOR_INTERVAL"] = str(EVERY_RANK_MONITOR_S)
    env.pop("TRAINING_BACKEND", None)  # MindSpeed-LLM's default (mcore) applies its patches
    start = time.monotonic()
    text = torchrun([str(llm / script), *argv], nproc, env, workdir, workdir / "log.txt",
                    timeout_s)
    ranks = [json.loads((record / f"rank{r}.json").read_text()) for r in range(nproc)]
    last = ranks[-1]  # Megatron logs on the last rank
    iterations = {int(i): v for i, v in last["iterations"].items()}
    return LoopRun(argv=argv, log=text, iterations=iterations,
                   counts=[r["counts"] for r in ranks], printed=parse_log(text),
                   seconds=time.monotonic() - start,
                   steady=[r.get("steady_state", {}) for r in ranks])


def torchrun(target: List[str], nproc: int, env: Dict[str, str], cwd: Path, log_path: Path,
             timeout_s: float, failure=LoopFailed) -> str:
    """``torchrun ... -m mindspeed_laga.launch *target`` on ``nproc`` gloo CPU ranks, run in
    ``cwd`` and logged to ``log_path``: the log's text, or ``failure(message, log)`` raised
    when it ran past ``timeout_s`` (every rank killed) or exited non-zero."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               "-m", "mindspeed_laga.launch", *target]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = None
    text = log_path.read_text(errors="replace")
    if returncode is None:
        raise failure(f"the run went past {timeout_s} s; log: {log_path}\n" + _tail(log_path), text)
    if returncode != 0:
        raise failure(f"the run failed (exit {returncode}); log: {log_path}\n" + _tail(log_path),
                      text)
    return text


def _tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")


def parse_log(text: str) -> Dict[int, dict]:
    """{iteration: {"lm loss": float, "mtp_1 loss": float, "grad norm": float, ...}} from
    Megatron's printed training log (6 significant decimals for losses, 3 for the norm)."""
    found = {}
    for match in _ITERATION.finditer(text):
        values = {}
        for part in match.group(2).split("|"):
            name, _, value = part.rpartition(":")
            name = name.strip()
            if name.endswith("loss") or name == "grad norm":
                values[name] = float(value)
        found[int(match.group(1))] = values
    return found


def prepare(sources: dict, workdir: Path, documents: List[int]) -> dict:
    """Writable sources and the dataset; returns the sources to run with and the data path.
    The dataset is built once (:func:`cached_dataset`) and copied into ``workdir / "data"``:
    Megatron writes its sample-index cache next to the data, and that stays the caller's."""
    run_sources = dict(sources, MEGATRON_SRC=str(writable_megatron(Path(sources["MEGATRON_SRC"]))))
    prefix = workdir / "data" / "tokens_text_document"
    if not prefix.with_suffix(".idx").is_file():
        built = cached_dataset(Path(run_sources["MEGATRON_SRC"]), documents)
        prefix.parent.mkdir(parents=True, exist_ok=True)
        for suffix in (".bin", ".idx"):  # the index last: its presence marks a whole copy
            shutil.copyfile(built.with_suffix(suffix), prefix.with_suffix(suffix))
    return dict(sources=run_sources, data_path=str(prefix))


def cached_dataset(megatron_src: Path, documents: List[int], seed: int = 1234) -> Path:
    """The prefix of the dataset :func:`build_dataset` writes for these documents, built once
    per Megatron source and kept in the test cache: every loop module and release trains on
    the same bytes. Building it imports Megatron in a subprocess (some 13 s of CPU), which
    each module and release used to pay again. Keyed by the Megatron source, the documents,
    the seed, the vocabulary and this file's text (the builder's code)."""
    from support.thirdparty import cache_dir

    key = hashlib.sha256("|".join([str(Path(megatron_src).resolve()), str(seed), str(VOCAB),
                                   ",".join(map(str, documents))]).encode()
                         + Path(__file__).read_bytes()).hexdigest()[:16]
    name = "tokens_text_document"
    target = _built_once(cache_dir().parent / "loop" / f"data-{key}", Path(f"{name}.idx"),
                         lambda staging: build_dataset(megatron_src, staging / name,
                                                       documents, seed))
    return target / name


def memoized_runs(sources: dict, workdir: Path, argv_for, timeout_s: float):
    """run(name, *args, **kwargs) -> LoopRun, each name run once in ``workdir / name``;
    ``argv_for(ready, *args, **kwargs)`` -> (argv, processes), ``ready`` being what
    :func:`prepare` returns (writable sources and the shared dataset)."""
    ready = prepare(sources, workdir, default_documents())
    runs = {}

    def run(name, *args, **kwargs):
        if name not in runs:
            argv, nproc = argv_for(ready, *args, **kwargs)
            runs[name] = run_loop(ready["sources"], workdir / name, nproc, argv,
                                  timeout_s=timeout_s)
        return runs[name]

    return run


def default_documents(count: int = 40, seed: int = 7) -> List[int]:
    """Document lengths (EOD included): varied, most shorter than a sequence."""
    import random
    rng = random.Random(seed)
    return [rng.randint(5, 40) for _ in range(count)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", default="master", help="the host release pair to run")
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--algo", default="ulysses_cp_algo")
    parser.add_argument("--ulysses-degree", type=int)
    parser.add_argument("--laga", action="store_true")
    parser.add_argument("--documents", action="store_true")
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (sets the ranks)")
    parser.add_argument("--set", action="append", default=[], metavar="FLAG=VALUE",
                        help="replace a stock flag's value (repeatable), e.g. "
                             "--set=--tensor-model-parallel-size=2")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--without", action="append", default=[], metavar="FLAG",
                        help="leave this stock flag out (repeatable), e.g. --without=--mtp-num-layers")
    parser.add_argument("extra", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    sys.path.insert(0, str(TESTS))
    from support.thirdparty import find_host_sources

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="laga-loop-"))
    ready = prepare(find_host_sources(args.release), workdir, default_documents())
    argv = recipe(Path(ready["sources"]["MINDSPEED_LLM_SRC"]), args.cp, args.algo, args.laga,
                  ready["data_path"], documents=args.documents, recompute=args.recompute,
                  ulysses_degree=args.ulysses_degree, extra=[a for a in args.extra if a != "--"],
                  without=args.without, layout=dict(item.split("=", 1) for item in args.set))
    print_run(run_loop(ready["sources"], workdir / "run", ranks(argv, args.dp), argv), workdir)


def print_run(run, workdir):
    """What a command-line run shows: each iteration's record, the counts per rank, the time."""
    for i in sorted(run.iterations):
        print(i, json.dumps(run.iterations[i]))
    print("counts per rank:", json.dumps(run.counts))
    print(f"{run.seconds:.1f} s; workdir {workdir}")


if __name__ == "__main__":
    main()

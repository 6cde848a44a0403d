"""Run MindSpeed-LLM's unmodified ``posttrain_gpt.py`` (SFT, LoRA) on gloo CPU ranks.

    torchrun --nproc-per-node N -m mindspeed_laga.launch posttrain_gpt.py <recipe flags>

The harness of tests/support/loop/real_loop.py (writable Megatron, CPU stand-ins,
per-rank counters and full-precision losses) runs the stock CP fine-tuning recipe
``examples/mcore/deepseek3/tune_deepseek3_671b_16k_lora_A3_ptd.sh`` (TP 1, PP 8, EP 16,
CP 2 ``ulysses_cp_algo``, 16k, ``--finetune --stage sft --is-instruction-dataset``, LoRA
r 8 / alpha 16 ``--lora-fusion`` on ``linear_qkv linear_proj linear_fc1 linear_fc2``, full
recompute), its flags read by running the script with ``python`` replaced by a printer,
then scaled down as the pretrain loop scales its recipe: dimensions shrunk, one node of
gloo CPU ranks, TP = PP = EP = 1, fp32, NPU-only fusions off. MLA with q-lora,
qk-layernorm and yarn rope, MoE with a shared expert, full recompute, the ``deepseek3``
prompt template and LoRA with ``--lora-fusion`` stay as the script has them. The data is
instruction data built by the host's ``preprocess_data.py`` with a tokenizer made here
(tests/support/loop/tune_data.py).

``python tests/support/loop/tune_loop.py [--release 26.1.0] --cp 2 --algo ulysses_cp_algo
[--laga] [--packed] [--lora-targets linear_qkv ... ] [-- extra flags]`` runs one case and
prints its losses.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

if __name__ == "__main__":  # run as a script: the tests folder holds ``support``
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from support.loop import real_loop, tune_data  # noqa: E402

TUNE_RECIPE = "tune_deepseek3_671b_16k_lora_A3_ptd.sh"
SCRIPT = "posttrain_gpt.py"
SEQ_LENGTH = 64
ITERATIONS = 4
MICRO_BATCHES = 2  # per iteration (global batch 2, micro-batch 1, DP 1)
STOCK_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
# what makes the script a LoRA SFT recipe; the loop keeps each as shipped
FINE_TUNING = ("--finetune", "--stage", "--is-instruction-dataset", "--lora-r", "--lora-alpha",
               "--lora-fusion", "--lora-target-modules", "--prompt-type")

# flag -> value: the tune recipe's dimensions and parallel sizes, shrunk as the pretrain
# loop shrinks its recipe's (the tokenizer's vocabulary is filled in per run)
SCALED = dict({flag: value for flag, value in real_loop.SCALED.items()
               if flag not in ("--tokenizer-type", "--vocab-size", "--padded-vocab-size")},
              **{"--seq-length": str(SEQ_LENGTH), "--max-position-embeddings": str(SEQ_LENGTH),
                 "--train-iters": str(ITERATIONS), "--global-batch-size": str(MICRO_BATCHES),
                 "--lr": "1e-2", "--min-lr": "1e-3"})
# flags of the tune recipe dropped here, and why: the pretrain loop's (real_loop.DROPPED),
# except the tokenizer (a local one), full recompute (kept as shipped) and
# --moe-router-enable-expert-bias (measured CP-invariant in the host on its own, unlike
# --seq-aux, real_loop.HOST_CP_VARIANT), plus these:
DROPPED = (real_loop.DROPPED - {"--tokenizer-name-or-path", "--recompute-method",
                                "--recompute-granularity", "--recompute-num-layers",
                                "--moe-router-enable-expert-bias"}) | {
    # NPU-only overlap of the MoE all-to-all (EP is 1 here)
    "--moe-alltoall-overlap-comm", "--moe-permutation-async-comm",
    # keeps a bf16 copy of the fp32 master weights: the run is fp32
    "--reuse-fp32-param",
    # the LoRA targets are each case's choice (tune_recipe's targets)
    "--lora-target-modules",
}


def stock_tune_flags(llm_src: Path) -> List[str]:
    """The arguments the stock tune script hands to posttrain_gpt.py, as shipped."""
    from support.recipes import RECIPE_DIR, recipe_argv
    return recipe_argv(Path(llm_src) / RECIPE_DIR / TUNE_RECIPE, dummies=Path("/placeholder"),
                       entry=SCRIPT)[0]


def tune_recipe(llm_src: Path, cp_size: int, cp_algo: str, laga: bool, data: dict,
                packed: bool = False, targets: Sequence[str] = STOCK_TARGETS,
                extra: Sequence[str] = (), without: Sequence[str] = ()) -> List[str]:
    """posttrain_gpt.py's arguments for one case: the stock tune recipe scaled down.
    ``data``: tune_data.build's result; ``packed``: the packed dataset with
    ``--reset-attention-mask``, else the padded one; ``targets``: --lora-target-modules."""
    stock = real_loop.flag_groups(stock_tune_flags(llm_src))
    names = {flag for flag, _ in stock}
    missing = [flag for flag in (*SCALED, *FINE_TUNING) if flag not in names]
    if missing:  # the stock script changed: the scaling no longer describes it
        raise RuntimeError(f"the stock tune recipe lacks {missing}")
    scaled = dict(SCALED, **{"--tokenizer-name-or-path": data["tokenizer"],
                             "--vocab-size": str(data["vocab"]),
                             "--padded-vocab-size": str(data["vocab"])})
    argv = []
    for flag, values in stock:
        if flag in DROPPED or flag in without:
            continue
        argv += [flag] + ([scaled[flag]] if flag in scaled else values)
    argv += real_loop.CPU_FLAGS + [
        "--data-path", data["packed" if packed else "padded"],
        "--context-parallel-size", str(cp_size), "--context-parallel-algo", cp_algo]
    if targets:
        argv += ["--lora-target-modules", *targets]
    if packed:
        argv += ["--reset-attention-mask"]
    if laga:
        argv += [real_loop.LAGA]
    return argv + list(extra)


def writable(sources: dict) -> dict:
    return dict(sources, MEGATRON_SRC=str(real_loop.writable_megatron(Path(sources["MEGATRON_SRC"]))))


def prepare_data(sources: dict) -> dict:
    """The tokenizer and both datasets, built with these host sources' preprocess_data.py
    (once: kept in the test cache, tune_data.cached_folder)."""
    return tune_data.build(writable(sources), tune_data.cached_folder(sources), SEQ_LENGTH)


def prepare(sources: dict, data: Optional[dict] = None) -> dict:
    """Writable sources and the data (``data``: already built, e.g. by another release's
    preprocess_data.py; the indexed format is the same)."""
    return dict(sources=writable(sources), data=data or prepare_data(sources))


def run(ready: dict, workdir: Path, cp: int, argv: List[str], timeout_s: float = 600):
    """posttrain_gpt.py argv on ``cp`` gloo CPU ranks.

    With left padding a pad query sees no key (its own and every earlier key are padding),
    and ``npu_fusion_attention`` called without ``inner_precise=2``, as the host calls it,
    leaves such rows unspecified: the stand-in computes them as zero there instead of
    refusing. They reach nothing that trains unless the router counts them
    (--moe-router-enable-expert-bias), which the left-padded case leaves out."""
    extra_env = {}
    if "--tokenizer-padding-side" in argv and argv[argv.index("--tokenizer-padding-side") + 1] == "left":
        from support.loop.bootstrap.loop_recorder import UNSPECIFIED_ROWS_ENV
        extra_env[UNSPECIFIED_ROWS_ENV] = "zero"
    return real_loop.run_loop(ready["sources"], workdir, cp, argv, timeout_s=timeout_s,
                              script=SCRIPT, extra_env=extra_env)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", default="master", help="the host release pair to run")
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--algo", default="ulysses_cp_algo")
    parser.add_argument("--laga", action="store_true")
    parser.add_argument("--packed", action="store_true", help="packed SFT (--reset-attention-mask)")
    parser.add_argument("--lora-targets", nargs="+", default=STOCK_TARGETS)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--without", action="append", default=[], metavar="FLAG")
    parser.add_argument("extra", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    from support.thirdparty import find_host_sources

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="laga-tune-"))
    ready = prepare(find_host_sources(args.release))
    argv = tune_recipe(Path(ready["sources"]["MINDSPEED_LLM_SRC"]), args.cp, args.algo,
                       args.laga, ready["data"], packed=args.packed, targets=args.lora_targets,
                       extra=[a for a in args.extra if a != "--"], without=args.without)
    real_loop.print_run(run(ready, workdir / "run", args.cp, argv), workdir)


if __name__ == "__main__":
    main()

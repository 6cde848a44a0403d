"""MindSpeed-LLM's DeepSeek-V3 128k recipe (``tests/poc/``), scaled down for the real loop.

The recipe is read as tests/support/recipes.py reads the stock one (its own bash expands
it) and shrunk as tests/support/loop/real_loop.py shrinks the stock recipe. What makes it
the long-context recipe stays: ``--reset-attention-mask --attention-mask-type general
--fix-sub-seq-length`` (documents of a fixed length, scaled down so that each sequence
holds several and their ends fall inside the CP ranks' slices), ``--shape-order BNSD``,
``--mla-mm-split``, ``--mla-fa-without-pad``, ``--transformer-impl transformer_engine``
(MindSpeed's TE modules) and full recompute.

``python tests/support/loop/long_recipe.py --cp 4 --algo ulysses_cp_algo [--laga]`` runs
one case and prints its losses.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from support.loop import real_loop  # noqa: E402

RECIPE = Path("tests") / "poc" / "deepseek3_671b_8p_acc" / "pretrain_deepseek3_0.9b_128k_bf16_A5_ptd.sh"
# 131072 tokens in fixed documents of 16384 (8 per sequence): here 64 tokens in documents
# of 12 (5 of 12 and one of 4), so at CP 4 (16 tokens per rank) most ends fall inside a
# rank's slice rather than on its edge
SUB_SEQ_LENGTH = 12

SCALED = dict(real_loop.SCALED, **{
    "--fix-sub-seq-length": str(SUB_SEQ_LENGTH),
    "--moe-shared-expert-intermediate-size": "32",
})
DROPPED = real_loop.DROPPED - {
    # the recipe's own full recompute stays
    "--recompute-method", "--recompute-granularity", "--recompute-num-layers",
} | {
    # the CPU ranks run every collective on gloo: no second (gloo) group to disable
    "--disable-gloo-group",
    # an NPU-only MoE fusion
    "--moe-permutation-async-comm",
    # the host's CP-local router terms (real_loop.HOST_CP_VARIANT): the recipe's
    # seq_aux_loss is computed per CP shard as well: "none", as the stock recipe has it
    "--moe-router-load-balancing-type",
}


def poc_flags(llm_src: Path) -> List[str]:
    """The arguments the 128k recipe hands to pretrain_gpt.py, as shipped."""
    from support.recipes import recipe_argv
    return recipe_argv(Path(llm_src) / RECIPE, dummies=Path("/placeholder"))[0]


def recipe(llm_src: Path, cp_size: int, cp_algo: str, laga: bool, data_path: str,
           ulysses_degree: Optional[int] = None, extra: Sequence[str] = ()) -> List[str]:
    """pretrain_gpt.py's arguments for one case of the scaled-down 128k recipe."""
    argv = []
    poc = real_loop.flag_groups(poc_flags(llm_src))
    names = {flag for flag, _ in poc}
    missing = [flag for flag in SCALED if flag not in names and flag not in _ABSENT_OK]
    if missing:  # the recipe changed: the scaling no longer describes it
        raise RuntimeError(f"the DeepSeek-V3 128k recipe lacks {missing}")
    for flag, values in poc:
        if flag in DROPPED:
            continue
        value = SCALED.get(flag)
        argv += [flag] + ([value] if value is not None else values)
    argv += real_loop.CPU_FLAGS + ["--data-path", data_path,
                                   "--context-parallel-size", str(cp_size),
                                   "--context-parallel-algo", cp_algo,
                                   "--reset-attention-mask",
                                   "--moe-router-load-balancing-type", "none"]
    if ulysses_degree:
        argv += ["--ulysses-degree-in-cp", str(ulysses_degree)]
    if laga:
        argv += [real_loop.LAGA]
    return argv + list(extra)


# SCALED flags of the stock recipe that the 128k recipe does not pass
_ABSENT_OK = {"--moe-router-topk-scaling-factor"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", default="master")
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--algo", default="ulysses_cp_algo")
    parser.add_argument("--ulysses-degree", type=int)
    parser.add_argument("--laga", action="store_true")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("extra", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    from support.thirdparty import find_host_sources

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="laga-long-"))
    ready = real_loop.prepare(find_host_sources(args.release), workdir,
                              real_loop.default_documents())
    argv = recipe(Path(ready["sources"]["MINDSPEED_LLM_SRC"]), args.cp, args.algo, args.laga,
                  ready["data_path"], ulysses_degree=args.ulysses_degree,
                  extra=[a for a in args.extra if a != "--"])
    real_loop.print_run(real_loop.run_loop(ready["sources"], workdir / "run",
                                           real_loop.ranks(argv), argv), workdir)


if __name__ == "__main__":
    main()

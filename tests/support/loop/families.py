"""MindSpeed-LLM's other MLA families in the real loop: each stock recipe, shrunk as
real_loop.recipe shrinks DeepSeek-V3's.

Every family builds ``CustomMLASelfAttention`` through its own spec: Kimi-K2
(``deepseek_spec``, yarn x32), DeepSeek-V2-Lite (no q-lora, ``--shape-order BNSD``),
PLM (``plm_spec``: no q-lora, no q layernorm, squared ReLU, no MoE), MiniCPM3
(``minicpm_spec``, longrope, scaled embeddings and depth) and LongCat-Flash (``longcat_spec``:
two MLA per layer, zero experts; its 128k recipe packs fixed-length sub-sequences with
``--reset-attention-mask --fix-sub-seq-length``).

``python tests/support/loop/families.py kimi2 --cp 2 --laga`` runs one case by hand and
prints its losses (``--documents`` for LongCat's packed sub-sequences, ``--set FLAG=VALUE``
to change a stock value, flags to add after ``--``).

A family's shrink is real_loop.SCALED restricted to the flags its recipe has (a recipe
without q-lora keeps none, one without MoE gets no experts), the run settings every case
needs (RUN) added where the recipe lacks them, and the family's own changes below.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple

TESTS = Path(__file__).resolve().parents[2]
if str(TESTS) not in sys.path:  # also when run as a script
    sys.path.insert(0, str(TESTS))
from support.loop import real_loop  # noqa: E402

# set whether or not the stock recipe has them: one node of CPU ranks, the tiny dataset
RUN = ("--seq-length", "--max-position-embeddings", "--micro-batch-size", "--global-batch-size",
       "--vocab-size", "--padded-vocab-size", "--tokenizer-type", "--train-iters", "--lr",
       "--min-lr", "--lr-warmup-iters", "--distributed-timeout-minutes",
       "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
       "--expert-model-parallel-size")
# stock flags no family case keeps, besides real_loop.DROPPED, and why
DROPPED = {
    # NPU-only memory swapping, fused kernels and stream overlap (no CPU path); the ring's
    # send/recv overlap (the cases run ulysses); bf16's fp32 parameter reuse (they run fp32)
    "--swap-attention", "--use-fused-moe-token-permute-and-unpermute",
    "--moe-alltoall-overlap-comm", "--use-cp-send-recv-overlap", "--reuse-fp32-param",
    # profiling, and the warm-up fraction RUN's --lr-warmup-iters replaces
    "--profile", "--profile-step-start", "--profile-step-end", "--profile-ranks",
    "--profile-level", "--profile-with-cpu", "--profile-record-shapes", "--profile-save-path",
    "--lr-warmup-fraction",
    # the data loader's worker processes: the default (2) is enough for 4 iterations
    "--num-workers",
}
MASTER = Path("examples") / "mcore"


def _every_fourth(values: List[str]) -> str:
    """A comma-separated list of per-frequency factors, for a rope dim a quarter as wide."""
    return ",".join(values[0].split(",")[::4])


@dataclass(frozen=True)
class Family:
    """One family's stock recipe and how its loop case runs."""
    script: Path                     # in MindSpeed-LLM
    cp: int = 2
    algo: str = "ulysses_cp_algo"
    # over real_loop.SCALED's values: flag -> value, or -> f(the stock values) -> value
    scaled: Dict[str, object] = field(default_factory=dict)
    without: Tuple[str, ...] = ()    # stock flags this family's case leaves out
    extra: Tuple[str, ...] = ()      # flags added
    mla_per_layer: int = 1
    entry: str = "pretrain_gpt.py"   # the host's training script the recipe starts


FAMILIES = {
    "kimi2": Family(MASTER / "kimi2" / "pretrain_kimi2_18b_4k_8p_ptd.sh",
                    # one router group as shipped (the recipe sets no group top-k)
                    scaled={"--moe-router-num-groups": "1"}),
    "deepseek2_lite": Family(MASTER / "deepseek2_lite" / "pretrain_deepseek2_lite_16b_ptd_8p.sh",
                             # a 40-document set leaves the 1% valid split empty, and
                             # Megatron's epoch count then never ends
                             scaled={"--split": "100,0,0"}),
    "plm": Family(MASTER / "plm" / "pretrain_plm_1point8b_ptd.sh",
                  scaled={"--num-query-groups": "4"}),
    # on branch 2.2.0 only (master keeps minicpm_spec); master's default TE impl needs
    # transformer_engine, so the local one. Its rope table is kv-channels x --rotary-percent
    # wide (64 x 0.5 = the rope dim, 32, one longrope factor per pair): the shrunk rope dim
    # 8 keeps every fourth factor; the sequence stays at the original length as shipped.
    # Its embeddings, scaled by 12 (--scale-emb), carry most of the grad norm (4x the other
    # families'), so clipping at 1.0 leaves attention a quarter of their step: at 4x the
    # learning rate attention learns enough in 4 iterations for a 1% softmax-scale error to
    # show (1.1e-5 in the loss; 1.6e-7, within the tolerance, at the others' rate)
    "minicpm3": Family(MASTER / "minicpm3" / "pretrain_minicpm3_4b_32k_ptd.sh",
                       scaled={"--long-factor": _every_fourth, "--short-factor": _every_fourth,
                               "--rope-scaling-original-max-position-embeddings": "64",
                               "--lr": "1.2e-2", "--min-lr": "1.2e-3"},
                       without=("--output-layer-slice-num",),
                       extra=("--transformer-impl", "local")),
    # the 128k recipe at CP 4: sub-sequences 1/8 of the sequence as shipped (16k of 128k);
    # --kv-channels must be the rope dim; the recipe's one layer holds two MLA. Its
    # --fix-router sends each rank's i-th token to experts (i x top-k ...) mod (experts +
    # zero experts), counted from the rank's first token: CP-invariant only when that
    # count divides a rank's tokens x top-k, as the shipped 384 does 16k x 12; here 8, 16 x 2
    "longcat": Family(Path("tests") / "poc" / "longcat_flash_chat" /
                      "pretrain_longcat_flash_560b_128k_8die_A5_ptd.sh", cp=4,
                      scaled={"--num-layers": "1", "--kv-channels": "8",
                              "--num-zero-experts": "4", "--fix-sub-seq-length": "8"},
                      mla_per_layer=2),
}
# DeepSeek-V4-Flash's 128k recipe at CP 2 (its own DeepSeek4SelfAttention: the flag is refused
# once the model is built); its DSA indexer flags, which LAGA refuses at validation, and the
# NPU-only fused mHC kernels are left out; one shared KV head as wide as the latent
DEEPSEEK4 = Family(Path("tests") / "poc" / "deepseek4_flash" /
                   "pretrain_deepseek4_flash_7.8b_128k_A3_ptd.sh", algo="kvallgather_cp_algo",
                   scaled={"--qk-head-dim": "32", "--o-lora-rank": "32", "--o-groups": "2",
                           "--moe-router-num-groups": "1"},
                   without=("--enable-dsa-indexer", "--index-n-heads", "--index-head-dim",
                            "--index-topk", "--use-fused-lightning-indexer-loss",
                            "--use-fused-lightning-indexer", "--use-sparse-flash-attn",
                            "--indexer-loss-coeff", "--use-triton-mhc", "--use-fused-mhc"),
                   entry="pretrain_deepseek4.py")


def family_named(name: str) -> Family:
    """A family of FAMILIES, or "deepseek4" (the recipe the flag is refused with)."""
    return DEEPSEEK4 if name == "deepseek4" else FAMILIES[name]


def family_scaled(family: Family, stock: List[str]) -> Tuple[Dict[str, str], List[str]]:
    """(flag -> shrunk value for the flags the stock recipe has, the RUN flags it lacks)."""
    present = dict(real_loop.flag_groups(stock))
    wanted = dict(real_loop.SCALED, **family.scaled)
    scaled = {flag: value(present[flag]) if callable(value) else value
              for flag, value in wanted.items() if flag in present}
    added = [token for flag in RUN if flag not in present for token in (flag, wanted[flag])]
    return scaled, added


def family_recipe(llm_src: Path, name: str, cp_size: int, laga: bool, data_path: str,
                  documents: bool = False, extra: List[str] = (),
                  layout: Dict[str, str] = None) -> List[str]:
    """pretrain_gpt.py's arguments for family ``name`` at ``cp_size``."""
    from support.recipes import recipe_argv

    family = family_named(name)
    stock = recipe_argv(Path(llm_src) / family.script, dummies=Path("/placeholder"),
                        entry=family.entry)[0]
    stock = [token for flag, values in real_loop.flag_groups(stock) if flag not in DROPPED
             for token in (flag, *values)]
    scaled, added = family_scaled(family, stock)
    return real_loop.recipe(llm_src, cp_size, family.algo, laga, data_path, documents=documents,
                            extra=[*added, *family.extra, *extra], without=family.without,
                            layout=layout, stock=stock, scaled=scaled)


def main():
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description="Run one family's shrunk stock recipe in the "
                                                 "real loop and print its losses.")
    parser.add_argument("family", choices=[*FAMILIES, "deepseek4"])
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--laga", action="store_true")
    parser.add_argument("--documents", action="store_true", help="--reset-attention-mask")
    parser.add_argument("--set", action="append", default=[], metavar="FLAG=VALUE",
                        help="replace a stock flag's value (repeatable), e.g. "
                             "--set=--moe-router-load-balancing-type=none")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="flags added, after --")
    args = parser.parse_args()
    from support.thirdparty import find_host_sources

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="laga-family-"))
    ready = real_loop.prepare(find_host_sources("master"), workdir, real_loop.default_documents())
    argv = family_recipe(Path(ready["sources"]["MINDSPEED_LLM_SRC"]), args.family, args.cp,
                         args.laga, ready["data_path"], documents=args.documents,
                         extra=[a for a in args.extra if a != "--"],
                         layout=dict(item.split("=", 1) for item in args.set))
    run = real_loop.run_loop(ready["sources"], workdir / "run", real_loop.ranks(argv), argv,
                             script=family_named(args.family).entry)
    real_loop.print_run(run, workdir)


if __name__ == "__main__":
    main()

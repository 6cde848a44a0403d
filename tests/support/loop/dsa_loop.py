"""MindSpeed-LLM's sparse MLA (DSA) recipes, scaled down for the real loop.

Five recipes of the master sources, read as tests/support/recipes.py reads any script:

- ``v32-16k``: DeepSeek-V3.2's 16K tune (``posttrain_gpt.py``: SFT with
  ``--is-instruction-dataset --prompt-type deepseek3 --no-pad-to-seq-lengths
  --pad-to-multiple-of``, ``ulysses_cp_algo``, the indexer's loss, its
  ``--use-fused-lightning-indexer``, which the host pairs with the fused indexer loss);
- ``v32-128k``: the 128K kvallgather tune of ``tests/poc/`` (SFT padded to the sequence,
  ``kvallgather_cp_algo``, every fused op: ``--use-fused-lightning-indexer
  --use-fused-lightning-indexer-loss --use-sparse-flash-attn --enable-mla-absorb``, and
  ``--mla-mm-split``);
- ``glm5``: GLM-5's 4k pretrain (``pretrain_gpt.py``: ``--enable-mla-absorb
  --use-sparse-flash-attn --mla-mm-split``, the indexer and its loss non-fused);
- ``v32-packed``: DeepSeek-V3.2's 4k pretrain (every fused op, the absorbed path) with
  packed documents, ``--reset-attention-mask`` added as a user packing the pretrain
  data would;
- ``glm52``: GLM-5.2's 4k pretrain (every fused op, the absorbed path, its shared
  picks as shipped: ``--index-topk-freq 4 --index-skip-topk-offset 3``), 4 layers so
  that one reuses another's picks, and MTP on: the script defines ``MTP_ARGS`` (one MTP
  layer, loss factor 0.3, memory-efficient logits) but leaves them off its command line;
  the case adds them as a user turning MTP on would. Its optimizer is SGD (below).

What changes from each recipe, and why:

- the dimensions shrink to what the fused NPU ops still accept (their CPU stand-ins,
  tests/support/fake_dsa_ops.py, check as the ops do): kv-lora-rank 512 and rope dim 64
  (the sparse attention's latent), index-head-dim 128, 8 attention heads and 8 index
  heads (the indexer loss's smallest counts); the rest as the other loop cases shrink
  theirs (hidden 64, q-lora 32, nope and value dims 16, index top-k 16, below every
  sequence), 2 layers (one dense, one MoE; the 128K recipe's one MoE layer as shipped),
  MoE with 4 tiny experts, MTP as shipped; 4 iterations at the pretrain loop's learning
  rate (3e-3: full fine-tuning, no LoRA);
- TP 1, PP 1, EP 1, no sequence parallelism (one rank per CP slot keeps each run to 2
  or 4 processes on a 2-core machine), no virtual pipeline, no recompute (it would only rerun the same forwards), fp32 (bf16 would hide
  small differences), NPU-only fusions and overlaps off (real_loop.DROPPED,
  families.DROPPED, EXTRA_DROPPED);
- the router's CP-local balance terms (``--seq-aux``, ``seq_aux_loss``,
  ``--moe-router-enable-expert-bias``, real_loop.HOST_CP_VARIANT) are left out, load
  balancing ``none``: the host computes them on each CP rank's tokens, so it trains
  another model at CP > 1 than at CP 1;
- the tune recipes read tests/support/loop/tune_data.py's instruction data and tokenizer
  (one build shared with the other fine-tune cases); its layout keeps the host's SFT
  CP-invariant (tune_data.check_labels): at 64 tokens for CP 2, and the 128K recipe at
  128 tokens for its CP 4 (zigzag chunks of 16 as CP 2's at 64). ``--pad-to-multiple-of``
  is the recipe's TP x CP at the case's sizes, in the reference too (so both pad alike);
- GLM-5, GLM-5.2 and V3.2's pretrain train on real_loop's random-token documents
  (NullTokenizer);
- ``v32-packed`` (V3.2's pretrain with ``--reset-attention-mask``) leaves MTP out
  (CASE_DROPPED), and its host run takes tests/support/loop/host_packed_dsa.py's fixes:
  as shipped, MindSpeed-LLM's packed DSA cannot run at CP 1 (that module says why);
- GLM-5.2 trains with SGD (``--optimizer sgd``, and so without the distributed optimizer,
  which Megatron allows with Adam only): Adam turns the float32 rounding by which CP 2's
  grads differ from CP 1's (5e-7 over the whole model at step 1, measured) into weight
  differences of up to 1.7e-2 of the learning rate in elements whose grads are near
  zero (``g / (|g| + eps)``), and the indexer's top-k is not continuous in its weights:
  with MTP on, a pick whose score lay 1.8e-4 from the 16th one's flipped in the MTP
  layer at iteration 2 (measured), and from there the runs parted by 2.5e-4 (indexer
  loss) and 1.5e-5 (grad norm), past the loop's tolerances though nothing in LAGA
  differs. Without MTP it happens too, depending on the machine: a CI run of the case
  before it had MTP, Adam as shipped, parted by 1.2e-4 in the loss at iteration 4 where
  an earlier run had stayed within 8.6e-8. Under SGD the same runs agree within 8.6e-8
  (losses), 1.0e-7 (grad norms) and 4.2e-7 (indexer losses) for all 4 iterations.

``python tests/support/loop/dsa_loop.py --cp 2 --laga [--non-fused] v32-16k`` runs one case
and prints its losses (``--non-fused``: without the fused flags the case leaves out,
NON_FUSED; ``--without FLAG`` leaves out any other).
"""
from __future__ import annotations

import argparse
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from support.loop import families, real_loop, tune_loop  # noqa: E402

# the shrunk dimensions of every DSA case (real_loop.SCALED's, widened where the fused ops
# demand it); flags a recipe lacks are added with these values
DSA_SCALED = dict(real_loop.SCALED, **{
    "--num-attention-heads": "8", "--kv-lora-rank": "512", "--qk-pos-emb-head-dim": "64",
    "--index-n-heads": "8", "--index-head-dim": "128", "--index-topk": "16",
    "--moe-shared-expert-intermediate-size": "32",
})
# DSA flags the recipes may leave at the host's default, set here (the default top-k 2048
# and 64 index heads are far beyond the shrunk model)
DSA_ADDED = ("--index-n-heads", "--index-head-dim", "--index-topk")
# stock flags left out besides real_loop.DROPPED and families.DROPPED, and why
EXTRA_DROPPED = {
    # TP 1: no sequence parallelism; PP 1: no virtual pipeline
    "--sequence-parallel", "--num-layers-per-virtual-pipeline-stage",
    # an NPU-only MoE overlap (EP is 1 here)
    "--moe-permutation-async-comm",
    # no tensorboard writer on the CPU ranks
    "--tensorboard-dir",
    # the router's CP-local balance (replaced by "none", see recipe())
    "--moe-router-load-balancing-type",
    # set per case (recipe())
    "--pad-to-multiple-of",
    # GLM-5.2's pipeline split of its 78 layers (PP 1 here)
    "--num-layer-list",
}
DEEPSEEK32 = Path("examples") / "mcore" / "deepseek32"


@dataclass(frozen=True)
class DsaRecipe:
    script: Path                    # in MindSpeed-LLM
    cp: int
    algo: str
    entry: str = "pretrain_gpt.py"
    sft: bool = False
    seq_length: int = real_loop.SEQ_LENGTH
    scaled: Dict[str, str] = field(default_factory=dict)  # over DSA_SCALED
    script_vars: Tuple[str, ...] = ()  # variables the script defines but does not pass
    added: Tuple[str, ...] = ()        # flags added after the recipe's (the reason: above)


RECIPES = {
    "v32-16k": DsaRecipe(DEEPSEEK32 / "tune_deepseek32_671b_16K_A3_full_ptd.sh", cp=2,
                         algo="ulysses_cp_algo", entry="posttrain_gpt.py", sft=True),
    "v32-128k": DsaRecipe(Path("tests") / "poc" / "deepseek32" /
                          "tune_deepseek32_671b_cut_128k_A3_ptd.sh", cp=4,
                          algo="kvallgather_cp_algo", entry="posttrain_gpt.py", sft=True,
                          seq_length=128, scaled={"--num-layers": "1"}),
    # one router group as shipped
    "glm5": DsaRecipe(Path("examples") / "mcore" / "glm5" / "pretrain_glm5_744b_4k_A3_ptd.sh",
                      cp=2, algo="ulysses_cp_algo",
                      scaled={"--moe-router-num-groups": "1", "--moe-router-group-topk": "1"}),
    # its shared picks as shipped (freq 4, offset 3): 4 layers, so layer 4 reuses layer 3's
    # (layers 1 to 3 compute theirs); one dense layer, three MoE; MTP on with the script's
    # own MTP_ARGS (its MTP layer computes its own picks); SGD (module docstring)
    # packed documents as a user adds them to the pretrain recipe (every fused op as
    # shipped): --reset-attention-mask, which the host runs on its fused ops only; no MTP
    # (CASE_DROPPED); the host's run with its fused calls fixed (host_packed_dsa.py)
    "v32-packed": DsaRecipe(DEEPSEEK32 / "pretrain_deepseek32_671b_4k_A3_ptd.sh", cp=2,
                            algo="ulysses_cp_algo", added=("--reset-attention-mask",)),
    "glm52": DsaRecipe(Path("examples") / "mcore" / "glm52" / "pretrain_glm52_744b_4k_A3_ptd.sh",
                       cp=2, algo="ulysses_cp_algo", scaled={"--num-layers": "4"},
                       script_vars=("MTP_ARGS",), added=("--optimizer", "sgd")),
}
# the recipe's fused flags ``--non-fused`` leaves out (the cases run them all)
NON_FUSED = {
    "v32-16k": ("--use-fused-lightning-indexer",),
    "v32-128k": ("--use-fused-lightning-indexer", "--use-fused-lightning-indexer-loss",
                 "--use-sparse-flash-attn", "--enable-mla-absorb"),
    "glm5": ("--use-sparse-flash-attn", "--enable-mla-absorb"),
    "v32-packed": ("--use-fused-lightning-indexer", "--use-fused-lightning-indexer-loss",
                   "--use-sparse-flash-attn", "--enable-mla-absorb"),
    "glm52": ("--use-fused-lightning-indexer", "--use-fused-lightning-indexer-loss",
              "--use-sparse-flash-attn", "--enable-mla-absorb"),
}
# each recipe's fused ops (tests/support/fake_dsa_ops.py) as the cases run them
FUSED_OPS = {
    "v32-16k": ("npu_lightning_indexer",),
    "v32-128k": ("npu_lightning_indexer", "npu_sparse_flash_attention",
                 "npu_sparse_lightning_indexer_grad_kl_loss"),
    "glm5": ("npu_sparse_flash_attention",),
    "v32-packed": ("npu_lightning_indexer", "npu_sparse_flash_attention",
                   "npu_sparse_lightning_indexer_grad_kl_loss"),
    # the indexer's ops run in the layers that compute their picks only (SHARING)
    "glm52": ("npu_lightning_indexer", "npu_sparse_flash_attention",
              "npu_sparse_lightning_indexer_grad_kl_loss"),
}
# the cases whose layers share picks: per model forward, how many MLA forwards run the
# indexer (layers 1 to 3 and the MTP layer) of how many (4 layers and the MTP layer)
SHARING = {"glm52": (4, 5)}
# flags a case leaves out besides EXTRA_DROPPED: SGD takes no distributed optimizer; the
# host's packed DSA cannot run MTP (its fused indexer gets every MTP depth's document ends
# as one list, e.g. [20, 39, 64, 19, 38, 64], which the op rejects as not cumulative)
CASE_DROPPED = {"glm52": {"--use-distributed-optimizer"},
                "v32-packed": {"--mtp-num-layers", "--mtp-loss-scaling-factor",
                               "--mtp-mem-efficient-logits"}}


def stock(llm_src: Path, case: str) -> List[str]:
    """The recipe's arguments to its entry script, as shipped, less the dropped flags."""
    from support.recipes import recipe_argv

    entry = RECIPES[case]
    script = Path(llm_src) / entry.script
    argv = recipe_argv(script, dummies=Path("/placeholder"), entry=entry.entry)[0]
    argv += [token for name in entry.script_vars for token in script_variable(script, name)]
    dropped = families.DROPPED | EXTRA_DROPPED | CASE_DROPPED.get(case, set())
    return [token for flag, values in real_loop.flag_groups(argv) if flag not in dropped
            for token in (flag, *values)]


def script_variable(script: Path, name: str) -> List[str]:
    """The arguments a recipe script's ``NAME="..."`` holds (e.g. GLM-5.2's MTP_ARGS,
    which it defines but leaves off its command line)."""
    found = re.search(rf'^{name}="([^"]*)"', Path(script).read_text(), flags=re.M)
    assert found, f"{script} defines no {name}"
    return shlex.split(found.group(1).replace("\\\n", " "))


def scaled_flags(entry: DsaRecipe, stock_argv: List[str], data: dict = None
                 ) -> Tuple[Dict[str, str], List[str]]:
    """(flag -> shrunk value for the recipe's flags, the flags it lacks with their values)."""
    present = dict(real_loop.flag_groups(stock_argv))
    wanted = dict(DSA_SCALED, **{"--seq-length": str(entry.seq_length),
                                 "--max-position-embeddings": str(entry.seq_length)},
                  **entry.scaled)
    if entry.sft:  # the local tokenizer
        wanted.update({"--tokenizer-type": "PretrainedFromHF", "--vocab-size": str(data["vocab"]),
                       "--padded-vocab-size": str(data["vocab"])})
    scaled = {flag: value for flag, value in wanted.items() if flag in present}
    added = [token for flag in (*families.RUN, *DSA_ADDED) if flag not in present
             for token in (flag, wanted[flag])]
    return scaled, added


def recipe(llm_src: Path, case: str, cp_size: int, laga: bool, data: dict,
           without: Sequence[str] = (), extra: Sequence[str] = ()) -> List[str]:
    """The entry script's arguments for ``case`` at ``cp_size``; ``data``: tune_data.build's
    result for the tune recipes, {"data_path": ...} for GLM-5; ``without``: recipe flags
    left out (e.g. NON_FUSED[case])."""
    entry = RECIPES[case]
    stock_argv = stock(llm_src, case)
    scaled, added = scaled_flags(entry, stock_argv, data)
    added += ["--moe-router-load-balancing-type", "none", *entry.added]
    if entry.sft:
        added += ["--tokenizer-name-or-path", data["tokenizer"]]
        if "--no-pad-to-seq-lengths" in stock_argv:  # the recipe's TP x CP, here TP 1
            added += ["--pad-to-multiple-of", str(entry.cp)]
    data_path = data["padded"] if entry.sft else data["data_path"]
    return real_loop.recipe(llm_src, cp_size, entry.algo, laga, data_path, stock=stock_argv,
                            scaled=scaled, without=without, extra=[*added, *extra])


def prepare(sources: dict, workdir: Path, case: str) -> dict:
    """Writable sources and the case's data: {"sources", "data"}."""
    if RECIPES[case].sft:
        return tune_loop.prepare(sources)
    ready = real_loop.prepare(sources, workdir, real_loop.default_documents())
    return dict(sources=ready["sources"], data=dict(data_path=ready["data_path"]))


def run(ready: dict, workdir: Path, case: str, argv: List[str], timeout_s: float = 600):
    """The case's entry script on CP-size gloo CPU ranks, the DSA stand-ins taking float32
    and ``torch.topk`` ordering ties by position: the host's indexer picks among index
    scores tied at exactly 0 (ReLU zeroes every head) across the k-th place, in an order
    the op leaves unspecified, and LAGA picks the lower positions (measured: with CPU's
    own order the 16K tune's losses part from LAGA's by 3e-5 at iteration 3, the host's
    CP 2 run staying with its CP 1 run; with the position order all three agree)."""
    from support.loop.bootstrap.loop_recorder import ORDERED_TOPK_ENV
    from support.loop.host_packed_dsa import HOST_PACKED_DSA_ENV
    env = {"FAKE_TORCH_NPU_WIDE_DTYPES": "1", ORDERED_TOPK_ENV: "1"}
    if "--reset-attention-mask" in argv and real_loop.LAGA not in argv:  # the host's own run
        env[HOST_PACKED_DSA_ENV] = "1"
    return real_loop.run_loop(ready["sources"], workdir, real_loop.ranks(argv), argv,
                              timeout_s=timeout_s, script=RECIPES[case].entry, extra_env=env)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=list(RECIPES))
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--laga", action="store_true")
    parser.add_argument("--non-fused", action="store_true")
    parser.add_argument("--without", action="append", default=[], metavar="FLAG",
                        help="leave this recipe flag out (repeatable)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("extra", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    from support.thirdparty import find_host_sources

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="laga-dsa-"))
    ready = prepare(find_host_sources("master"), workdir, args.case)
    argv = recipe(Path(ready["sources"]["MINDSPEED_LLM_SRC"]), args.case, args.cp, args.laga,
                  ready["data"],
                  without=[*args.without, *(NON_FUSED[args.case] if args.non_fused else ())],
                  extra=[a for a in args.extra if a != "--"])
    real_loop.print_run(run(ready, workdir / "run", args.case, argv), workdir)


if __name__ == "__main__":
    main()

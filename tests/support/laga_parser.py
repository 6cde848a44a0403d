"""An argparse parser with LAGA's flags and the upstream flags LAGA's checks read.

The Megatron / MindSpeed / MindSpeed-LLM flags are declared with their upstream
names, defaults and destinations (e.g. ``--disable-bias-linear`` stores False
into ``add_bias_linear``; ``--fp8-format`` stores into ``fp8``).
"""
import argparse

from mindspeed_laga.features import LAGAFeature


def upstream_flags(parser):
    """The Megatron / MindSpeed(-LLM) flags LAGA's checks read, as upstream declares them."""
    add = parser.add_argument
    add("--optimization-level", type=int, choices=[0, 1, 2], default=2)
    add("--multi-latent-attention", action="store_true")
    add("--attention-dropout", type=float, default=0.1)
    add("--num-attention-heads", type=int, default=None)
    add("--seq-length", type=int, default=None)
    add("--tensor-model-parallel-size", type=int, default=1)
    add("--context-parallel-size", type=int, default=1)
    add("--micro-batch-size", type=int, default=None)
    add("--ulysses-degree-in-cp", type=int, default=None)
    add("--context-parallel-algo", default="megatron_cp_algo",
        choices=["megatron_cp_algo", "hybrid_cp_algo", "hybrid_adaptive_cp_algo",
                 "kvallgather_cp_algo", "ulysses_cp_algo"])
    add("--attention-mask-type", default="causal", choices=["causal", "general"])
    add("--shape-order", default="SBH", choices=["SBH", "BSH", "BSND", "BNSD", "TND"])
    add("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    add("--fp8-format", default=None, choices=["e4m3", "hybrid", "hif8"], dest="fp8")
    add("--fp8-recipe", default="delayed",
        choices=["tensorwise", "delayed", "mxfp8", "blockwise", "mxfp8-32x32"])
    add("--fp8-reuse-quantized-weight", action="store_true")  # MindSpeed's TE feature
    add("--qk-head-dim", type=int, default=None)
    add("--v-head-dim", type=int, default=None)
    add("--recompute-granularity", default=None, choices=["full", "selective"])
    add("--pad-to-multiple-of", type=int, default=8)  # MindSpeed-LLM's dataset feature
    add("--no-pad-to-seq-lengths", action="store_true")  # its finetune feature
    add("--lora-target-modules", nargs="+", type=str, default=[])
    add("--lu-lora-final-layer-index", type=int, default=None)
    for flag in ("--enable-mla-absorb", "--use-sparse-flash-attn", "--enable-dsa-indexer",
                 "--reset-attention-mask", "--reset-position-ids", "--neat-pack", "--tp-2d",
                 "--mla-up-proj-tp-overlap", "--recompute-mla-up-proj", "--mla-zero-memory",
                 "--mla-swap-core-attn-out", "--add-qkv-bias", "--qlora",
                 # MindSpeed-LLM's DSA feature (sparse MLA)
                 "--use-fused-lightning-indexer", "--use-fused-lightning-indexer-loss",
                 "--kv-compress", "--index-share-for-mtp-iteration", "--sequence-parallel"):
        add(flag, action="store_true")
    add("--index-topk-freq", type=int, default=1)
    add("--index-skip-topk-offset", type=int, default=2)
    add("--index-topk-pattern", type=str, default=None)


def parser_with_laga(feature=None):
    parser = argparse.ArgumentParser(allow_abbrev=False)
    upstream_flags(parser)
    (feature or LAGAFeature()).register_args(parser)
    return parser


def parse(argv, feature=None):
    return parser_with_laga(feature).parse_args(argv)

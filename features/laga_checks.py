"""Which MindSpeed-LLM configurations LAGA covers, checked on the parsed arguments.

Run after Megatron's and the other features' validation (LAGAFeature is the
last feature in the list), so ``multi_latent_attention`` and
``context_parallel_size`` hold their final values. Every rejection is a
``ValueError`` that names the flag and the fix, raised before any process
group exists.
"""
from __future__ import annotations

import importlib.util
from argparse import Namespace

from .laga_args import CP_ALGO_MAP, DEFAULT_CP_ALGO, FLAG, cp_algo_and_layout

_PACKED = ("packed (THD) sequences are not covered by LAGA: train on unpacked causal "
           "sequences (drop {flag}) or drop " + FLAG)
_UP_PROJ = ("LAGA rebuilds K/V itself after the latent all-gather, so this option of the "
            "original up-projection does not apply: drop {flag} or drop " + FLAG)

# (args attribute, flag, why and how to fix); a truthy attribute is rejected
_INCOMPATIBLE = (
    ("enable_mla_absorb", "--enable-mla-absorb",
     "LAGA is the non-absorbed form (absorption keeps n*kv_lora_rank-wide activations in "
     "training): drop {flag} or drop " + FLAG),
    ("use_sparse_flash_attn", "--use-sparse-flash-attn",
     "LAGA runs dense causal attention: drop {flag} or drop " + FLAG),
    ("enable_dsa_indexer", "--enable-dsa-indexer",
     "the DSA indexer needs sparse per-head attention that LAGA does not run: drop {flag} "
     "or drop " + FLAG),
    ("reset_attention_mask", "--reset-attention-mask", _PACKED),
    ("reset_position_ids", "--reset-position-ids", _PACKED),
    ("neat_pack", "--neat-pack", _PACKED),
    ("tp_2d", "--tp-2d",
     "2-D tensor parallelism splits the CP batch in its own way, not one LAGA knows: "
     "drop {flag} or drop " + FLAG),
    ("mla_up_proj_tp_overlap", "--mla-up-proj-tp-overlap", _UP_PROJ),
    ("recompute_mla_up_proj", "--recompute-mla-up-proj", _UP_PROJ),
    ("mla_zero_memory", "--mla-zero-memory", _UP_PROJ),
    ("mla_swap_core_attn_out", "--mla-swap-core-attn-out", _UP_PROJ),
    ("add_qkv_bias", "--add-qkv-bias",
     "LAGA rebuilds K/V from linear_kv_up_proj.weight alone: drop {flag} or drop " + FLAG),
    ("fp8", "--fp8-format",
     "LAGA's attention runs in the training dtype, not FP8: drop {flag} or drop " + FLAG),
)

# (args attribute, value, flag as the user writes it, why and how to fix)
_INCOMPATIBLE_VALUES = (
    ("shape_order", "TND", "--shape-order TND", _PACKED),
    ("attention_mask_type", "general", "--attention-mask-type general",
     "LAGA's attention is causal: use --attention-mask-type causal or drop " + FLAG),
    ("recompute_granularity", "selective", "--recompute-granularity selective",
     "LAGA does not checkpoint its core attention yet: use --recompute-granularity full, "
     "no recompute, or drop " + FLAG),
)


def check_laga_args(args: Namespace) -> bool:
    """Raise ``ValueError`` for what LAGA does not cover; False: LAGA is a no-op (CP=1)."""
    if not getattr(args, "multi_latent_attention", False):
        raise ValueError(f"{FLAG} needs --multi-latent-attention (LAGA is how MLA attends under "
                         f"context parallelism): add --multi-latent-attention or drop {FLAG}")
    cp_size = context_parallel_size(args)
    if cp_size == 1:
        return False
    _check_incompatible(args)
    _check_attention_dropout(args)
    cp_algo, layout = _check_cp_algo(args)
    _check_split(args, cp_size, cp_algo, layout)
    _check_kernel(args)
    _check_options(args)
    return True


def context_parallel_size(args: Namespace) -> int:
    return int(getattr(args, "context_parallel_size", None) or 1)


def _check_incompatible(args: Namespace) -> None:
    for attr, flag, why in _INCOMPATIBLE:
        if getattr(args, attr, None):
            raise ValueError(f"{FLAG} with {flag} is not supported: " + why.format(flag=flag))
    for attr, value, flag, why in _INCOMPATIBLE_VALUES:
        if getattr(args, attr, None) == value:
            raise ValueError(f"{FLAG} with {flag} is not supported: " + why.format(flag=flag))
    # Megatron adds biases to every linear unless told otherwise
    if getattr(args, "add_bias_linear", False):
        raise ValueError(f"{FLAG} needs linear_kv_up_proj without a bias (LAGA rebuilds K/V from "
                         "its weight alone): pass --disable-bias-linear, as the DeepSeek scripts "
                         f"do, or drop {FLAG}")


def _check_attention_dropout(args: Namespace) -> None:
    # LAGA's attention has no dropout; Megatron's default is 0.1, so a script
    # that does not set it would otherwise train a different model silently
    dropout = getattr(args, "attention_dropout", None) or 0.0
    if dropout > 0:
        raise ValueError(f"{FLAG} with --attention-dropout {dropout} is not supported: LAGA's "
                         "attention applies no dropout (Megatron's default is 0.1). Pass "
                         f"--attention-dropout 0.0, as the DeepSeek scripts do, or drop {FLAG}")


def _algo(args: Namespace) -> str:
    return getattr(args, "context_parallel_algo", None) or DEFAULT_CP_ALGO


def _check_cp_algo(args: Namespace):
    algo = _algo(args)
    mapped = cp_algo_and_layout(algo)
    if mapped is not None:
        return mapped
    if algo == "hybrid_cp_algo":
        raise ValueError(
            f"{FLAG} with --context-parallel-algo hybrid_cp_algo is not supported: it nests "
            "Ulysses groups inside a ring (two CP groups, each rank holding a contiguous piece "
            "of a zigzag chunk pair), a layout LAGA does not cover. Use --context-parallel-algo "
            "ulysses_cp_algo or kvallgather_cp_algo (the latent all-gather is 576 values per "
            f"token), or drop {FLAG}")
    raise ValueError(f"{FLAG} with --context-parallel-algo {algo} is not supported: use one of "
                     f"{', '.join(sorted(CP_ALGO_MAP))}, or drop {FLAG}")


def _check_split(args: Namespace, cp_size: int, cp_algo: str, layout: str) -> None:
    heads = int(args.num_attention_heads)
    tp_size = int(getattr(args, "tensor_model_parallel_size", None) or 1)
    seq_length = int(args.seq_length)
    if cp_algo == "ulysses" and heads % (tp_size * cp_size):
        raise ValueError(
            f"{FLAG} with ulysses_cp_algo splits each TP rank's heads over CP: "
            f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size "
            f"{tp_size} x --context-parallel-size {cp_size}; choose sizes whose product divides "
            "the heads, or use --context-parallel-algo kvallgather_cp_algo")
    chunks = 2 * cp_size if layout == "zigzag" else cp_size
    if seq_length % chunks:
        what = "2 x --context-parallel-size" if layout == "zigzag" else "--context-parallel-size"
        raise ValueError(
            f"{FLAG} with --context-parallel-algo {_algo(args)} cuts the sequence into {what} "
            f"= {chunks} equal chunks: --seq-length {seq_length} is not divisible by {chunks}; "
            f"pad --seq-length to a multiple of {chunks}")


def _check_kernel(args: Namespace) -> None:
    wants_npu = getattr(args, "mla_laga_kernel", None) == "npu"
    if wants_npu and importlib.util.find_spec("torch_npu") is None:
        raise ValueError("--mla-laga-kernel npu needs torch_npu (Ascend CANN + torch_npu); "
                         "install it or use --mla-laga-kernel auto")


def _check_options(args: Namespace) -> None:
    block = getattr(args, "mla_laga_kv_block_size", None)
    if block is None:
        return
    if block <= 0:
        raise ValueError(f"{FLAG} with --mla-laga-kv-block-size {block}: the block size must be a "
                         "positive number of keys")
    if not getattr(args, "mla_laga_recompute_kv", False):
        raise ValueError(f"{FLAG} with --mla-laga-kv-block-size needs --mla-laga-recompute-kv "
                         "(blockwise rebuild keeps no K/V for backward): add "
                         "--mla-laga-recompute-kv or drop the block size")

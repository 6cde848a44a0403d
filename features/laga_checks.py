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

from mindspeed_laga.cp_algos import algo
from mindspeed_laga.vocab.names import HYBRID
from mindspeed_laga.vocab.segments import seq_multiple

from .dsa_checks import check_dsa
from .laga_args import (CP_ALGO_MAP, DOCUMENT_CP_ALGO_MAP, FLAG, GENERAL_CP_ALGO_MAP,
                        context_parallel_algo, cp_algo_and_layout, general_mask)
from .laga_fp8_checks import check_fp8

_PACKED = ("this packed (THD) form is not covered by LAGA: pack documents with "
           "--reset-attention-mask and --micro-batch-size 1 instead (drop {flag}), or drop " + FLAG)
_UP_PROJ = ("LAGA rebuilds K/V itself after the latent all-gather, so this option of the "
            "original up-projection does not apply: drop {flag} or drop " + FLAG)

# (args attribute, flag, why and how to fix); a truthy attribute is rejected
_INCOMPATIBLE = (
    ("enable_mla_absorb", "--enable-mla-absorb",
     "LAGA is the non-absorbed form (absorption keeps n*kv_lora_rank-wide activations in "
     "training): drop {flag} or drop " + FLAG),
    ("use_sparse_flash_attn", "--use-sparse-flash-attn",
     "LAGA runs dense causal attention: drop {flag} or drop " + FLAG),
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
    ("qlora", "--qlora",
     "QLoRA stores every parallel linear's base weight in 4 bits, linear_kv_up_proj's "
     "included, and LAGA rebuilds K/V from that weight as a matrix: fine-tune with LoRA "
     "(drop {flag}, keep --lora-target-modules) or drop " + FLAG),
)
# what the refusals above name that LAGA's sparse MLA (DSA) runs (dsa_checks.py): its
# attention is absorbed MQA over the latent, on the host's sparse flash attention op or not
_DSA_RUNS = ("enable_mla_absorb", "use_sparse_flash_attn")
# the modules LAGA reads as a weight instead of calling them (fused; --mla-mm-split)
KV_UP_MODULES = ("linear_kv_up_proj", "linear_kv_nope", "linear_v")

# (args attribute, value, flag as the user writes it, why and how to fix)
_INCOMPATIBLE_VALUES = (
    ("shape_order", "TND", "--shape-order TND", _PACKED),
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
    dsa = check_dsa(args)  # sparse MLA first: its refusals name DSA (dsa_checks.py)
    _check_incompatible(args, dsa)
    _check_lora(args)
    _check_attention_dropout(args)
    _check_documents(args)
    _check_general(args)
    cp_algo, layout = _check_cp_algo(args)
    _check_split(args, cp_size, cp_algo, layout, heads_split=not dsa)
    _check_padded_lengths(args, cp_size, cp_algo, layout)
    _check_kernel(args)
    _check_options(args)
    check_fp8(args)
    return True


def context_parallel_size(args: Namespace) -> int:
    return int(getattr(args, "context_parallel_size", None) or 1)


def _check_incompatible(args: Namespace, dsa: bool = False) -> None:
    for attr, flag, why in _INCOMPATIBLE:
        if getattr(args, attr, None) and not (dsa and attr in _DSA_RUNS):
            raise ValueError(f"{FLAG} with {flag} is not supported: " + why.format(flag=flag))
    for attr, value, flag, why in _INCOMPATIBLE_VALUES:
        if attr == "shape_order" and _documents(args):
            continue  # MindSpeed-LLM sets TND itself under --reset-attention-mask
        if getattr(args, attr, None) == value:
            raise ValueError(f"{FLAG} with {flag} is not supported: " + why.format(flag=flag))
    # Megatron adds biases to every linear unless told otherwise
    if getattr(args, "add_bias_linear", False):
        raise ValueError(f"{FLAG} needs linear_kv_up_proj without a bias (LAGA rebuilds K/V from "
                         "its weight alone): pass --disable-bias-linear, as the DeepSeek scripts "
                         f"do, or drop {FLAG}")


def lora_kv_up_targets(args: Namespace) -> list:
    """The --lora-target-modules entries that wrap a K/V up-projection: peft wraps every
    module whose dotted name ends with a target, so a target's last component decides."""
    targets = getattr(args, "lora_target_modules", None) or []
    return [t for t in targets if t.split(".")[-1] in KV_UP_MODULES]


def _check_lora(args: Namespace) -> None:
    """LoRA on the K/V up-projection: LAGA reads its effective weight (base + delta,
    patches/lora.py), which only plain LoRA has; LU-LoRA's layers update their adapters
    inside their own forward, which LAGA does not call for those modules."""
    targets = lora_kv_up_targets(args)
    if targets and getattr(args, "lu_lora_final_layer_index", None) is not None:
        listed = " ".join(targets)
        raise ValueError(
            f"{FLAG} with --lu-lora-final-layer-index and --lora-target-modules {listed} is "
            "not supported: LU-LoRA trains its adapters inside the wrapped module's forward, "
            f"and LAGA rebuilds K/V from the weights of {listed} without calling them. Remove "
            f"{listed} from --lora-target-modules, drop --lu-lora-final-layer-index, or drop "
            f"{FLAG}")


def _check_attention_dropout(args: Namespace) -> None:
    # LAGA's attention has no dropout; Megatron's default is 0.1, so a script
    # that does not set it would otherwise train a different model silently
    dropout = getattr(args, "attention_dropout", None) or 0.0
    if dropout > 0:
        raise ValueError(f"{FLAG} with --attention-dropout {dropout} is not supported: LAGA's "
                         "attention applies no dropout (Megatron's default is 0.1). Pass "
                         f"--attention-dropout 0.0, as the DeepSeek scripts do, or drop {FLAG}")


def _documents(args: Namespace) -> bool:
    return bool(getattr(args, "reset_attention_mask", False))


def _check_documents(args: Namespace) -> None:
    """--reset-attention-mask: one packed sequence per micro-batch (the document
    boundaries MindSpeed keeps are those of one sequence)."""
    if not _documents(args):
        return
    micro_batch = int(getattr(args, "micro_batch_size", None) or 1)
    if micro_batch != 1:
        raise ValueError(f"{FLAG} with --reset-attention-mask needs --micro-batch-size 1 (the "
                         "document boundaries describe one packed sequence); got "
                         f"--micro-batch-size {micro_batch}: pass --micro-batch-size 1 (raise "
                         "--global-batch-size's accumulation instead), or drop " + FLAG)


def _check_general(args: Namespace) -> None:
    """--attention-mask-type general: covered where it describes packed documents (with
    --reset-attention-mask: MindSpeed's actual_seq_len, fixed with --fix-sub-seq-length);
    without them the mask is whatever the loader built, which LAGA does not read."""
    if not general_mask(args):
        return
    if not _documents(args):
        raise ValueError(
            f"{FLAG} with --attention-mask-type general is supported with "
            "--reset-attention-mask only (documents from the data's EOD, or of a fixed length "
            "with --fix-sub-seq-length): without it MindSpeed attends under the loader's "
            "dense mask, which LAGA does not read. Add --reset-attention-mask, use "
            f"--attention-mask-type causal, or drop {FLAG}")
    algo = context_parallel_algo(args)
    if algo not in GENERAL_CP_ALGO_MAP:
        raise ValueError(
            f"{FLAG} with --attention-mask-type general and --context-parallel-algo {algo} "
            "is not supported: use one of "
            f"{', '.join(sorted(GENERAL_CP_ALGO_MAP))} (MindSpeed's splits for general masks), "
            f"--attention-mask-type causal, or drop {FLAG}")


def _check_cp_algo(args: Namespace):
    algo = context_parallel_algo(args)
    mapped = cp_algo_and_layout(algo, _documents(args), general_mask(args))
    if mapped is not None:
        return mapped
    if algo == "hybrid_cp_algo" and _documents(args):
        raise ValueError(
            f"{FLAG} with --context-parallel-algo hybrid_cp_algo and --reset-attention-mask is "
            "not supported: MindSpeed splits packed documents per ring there, a layout LAGA "
            f"does not cover. Use one of {', '.join(sorted(DOCUMENT_CP_ALGO_MAP))} with "
            "--reset-attention-mask, --attention-mask-type general (split contiguously, "
            f"covered), or drop {FLAG}")
    raise ValueError(f"{FLAG} with --context-parallel-algo {algo} is not supported: use one of "
                     f"{', '.join(sorted(CP_ALGO_MAP))}, or drop {FLAG}")


def _check_split(args: Namespace, cp_size: int, cp_algo: str, layout: str,
                 heads_split: bool = True) -> None:
    """``heads_split`` False: LAGA keeps every head on every rank (DSA), whatever the
    algorithm's own rule on heads."""
    heads = int(args.num_attention_heads)
    tp_size = int(getattr(args, "tensor_model_parallel_size", None) or 1)
    seq_length = int(args.seq_length)
    split = algo(cp_algo)
    if heads_split and split.takes_ulysses_degree:
        _check_hybrid(args, heads, tp_size, cp_size)
    elif heads_split and not _heads_divide(split, heads, tp_size, cp_size):
        raise ValueError(
            f"{FLAG} with ulysses_cp_algo splits each TP rank's heads over CP: "
            f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size "
            f"{tp_size} x --context-parallel-size {cp_size}; choose sizes whose product divides "
            "the heads, or use --context-parallel-algo kvallgather_cp_algo")
    chunks = cp_size if layout == "contiguous" else 2 * cp_size
    if seq_length % chunks:
        what = "--context-parallel-size" if layout == "contiguous" else "2 x --context-parallel-size"
        raise ValueError(
            f"{FLAG} with --context-parallel-algo {context_parallel_algo(args)} cuts the sequence into {what} "
            f"= {chunks} equal chunks: --seq-length {seq_length} is not divisible by {chunks}; "
            f"pad --seq-length to a multiple of {chunks}")


def sequence_multiple(args: Namespace, cp_size: int, cp_algo: str, layout: str) -> int:
    """Every full sequence length LAGA meets must be a multiple of this."""
    takes_degree = algo(cp_algo).takes_ulysses_degree
    degree = int(getattr(args, "ulysses_degree_in_cp", None) or 1) if takes_degree else 1
    return seq_multiple(layout, cp_size, degree)


def padded_length_error(length: int, multiple: int, flag: str) -> str:
    """What --no-pad-to-seq-lengths with a --pad-to-multiple-of LAGA cannot split says."""
    return (f"{FLAG} with --no-pad-to-seq-lengths and {flag}: each batch is padded to a "
            f"multiple of --pad-to-multiple-of, here {length}, which the CP split needs to be a "
            f"multiple of {multiple}; pass --pad-to-multiple-of with a multiple of {multiple} "
            "(or drop --no-pad-to-seq-lengths to pad every batch to --seq-length)")


def _check_padded_lengths(args: Namespace, cp_size: int, cp_algo: str, layout: str) -> None:
    """--no-pad-to-seq-lengths: each SFT batch gets its own length, a multiple of
    --pad-to-multiple-of (default 8), which the check on --seq-length never sees."""
    if not getattr(args, "no_pad_to_seq_lengths", False) or _documents(args):
        return
    multiple = sequence_multiple(args, cp_size, cp_algo, layout)
    pad_to = int(getattr(args, "pad_to_multiple_of", None) or 1)
    if pad_to % multiple:
        raise ValueError(padded_length_error(pad_to, multiple,
                                             f"--pad-to-multiple-of {pad_to}"))


def _heads_divide(split, heads: int, tp_size: int, cp_size: int, degree: int = 1) -> bool:
    """The algorithm's rule on one TP rank's heads (--num-attention-heads / TP)."""
    per_rank, rest = divmod(heads, tp_size)
    if not split.heads_split(cp_size, degree):
        return True
    return rest == 0 and split.heads_divide(per_rank, cp_size, degree)


def _check_hybrid(args: Namespace, heads: int, tp_size: int, cp_size: int) -> None:
    """hybrid_cp_algo: heads split over each Ulysses group of --ulysses-degree-in-cp ranks."""
    degree = getattr(args, "ulysses_degree_in_cp", None)
    split = algo(HYBRID)
    if not degree or degree <= 1 or not split.degree_divides(cp_size, degree) or degree == cp_size:
        raise ValueError(
            f"{FLAG} with --context-parallel-algo hybrid_cp_algo needs --ulysses-degree-in-cp U "
            f"with 1 < U < --context-parallel-size {cp_size} and U dividing it; got {degree}: "
            "set it, or use --context-parallel-algo ulysses_cp_algo or kvallgather_cp_algo")
    if not _heads_divide(split, heads, tp_size, cp_size, degree):
        raise ValueError(
            f"{FLAG} with hybrid_cp_algo splits each TP rank's heads over the Ulysses group: "
            f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size "
            f"{tp_size} x --ulysses-degree-in-cp {degree}; choose sizes whose product divides "
            "the heads")


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

"""Which FP8 trainings (``--fp8-format``, MindSpeed's TE modules) LAGA serves.

LAGA rebuilds K/V through the K/V module's own FP8 matmul (patches/mindspeed_llm/fp8.py).
That equals the host's up-projection when every quantization block the host forms holds
the same values in LAGA's call: true for MX scaling (``--fp8-recipe mxfp8``: blocks of 32
along the latent of one token, along the K/V features of one token, along 32 tokens),
given head dims that are multiples of 32. Each refusal below names the case where a block
or a scale would differ, or where nothing checks the result.
"""
from __future__ import annotations

from argparse import Namespace

from .laga_args import FLAG

MX_BLOCK = 32
SERVED_RECIPES = ("mxfp8",)
# recipe -> why LAGA's rebuild would not equal the host's module
_RECIPES = {
    "tensorwise": "one scale per tensor: a LAGA rank quantizes other tensors than the host's "
                  "module does (the rows of its heads under ulysses/hybrid, the K/V gradient "
                  "of its own queries only), so the scales and every quantized value differ",
    "delayed": "one scale per tensor from an amax history: a LAGA rank quantizes other tensors "
               "than the host's module does (the rows of its heads, the K/V gradient of its "
               "own queries), so the history and every quantized value differ",
    "blockwise": "its 128x128 weight blocks and 1x128 activation blocks have no CPU stand-in "
                 "of npu_dynamic_block_quant to check LAGA's rebuild against",
    "mxfp8-32x32": "its 32x32 weight blocks have no CPU stand-in of "
                   "npu_dynamic_block_mx_quant to check LAGA's rebuild against",
}


def check_fp8(args: Namespace) -> None:
    """Raise ``ValueError`` for an FP8 training LAGA does not serve (no-op without FP8)."""
    if not getattr(args, "fp8", None):
        return
    recipe = getattr(args, "fp8_recipe", None)
    recipe = getattr(recipe, "value", recipe)
    if recipe not in SERVED_RECIPES:
        why = _RECIPES.get(recipe, "no check of LAGA's rebuild covers it")
        raise ValueError(f"{FLAG} with --fp8-recipe {recipe} is not supported: {why}. Use "
                         f"--fp8-recipe mxfp8 or drop {FLAG}")
    if getattr(args, "fp8_reuse_quantized_weight", False):
        raise ValueError(f"{FLAG} with --fp8-reuse-quantized-weight is not supported: the reuse "
                         "cache keys a quantized weight by the parameter's storage, so the rows "
                         "of one head block (ulysses/hybrid) or the LoRA base would be served the "
                         "whole weight's entry, and it frees the bf16 weight LAGA slices. Drop "
                         f"--fp8-reuse-quantized-weight or drop {FLAG}")
    if getattr(args, "mla_laga_recompute_kv", False):
        raise ValueError(f"{FLAG} with --mla-laga-recompute-kv and --fp8-format is not "
                         "supported: the blockwise recompute differentiates the up-projection "
                         "itself as a plain matmul, not through the module's FP8 matmul. Drop "
                         "--mla-laga-recompute-kv or --fp8-format")
    for flag in ("qk_head_dim", "v_head_dim"):
        dim = getattr(args, flag, None)
        if dim is not None and dim % MX_BLOCK:
            raise ValueError(
                f"{FLAG} with --fp8-format needs --{flag.replace('_', '-')} a multiple of "
                f"{MX_BLOCK} (got {dim}): MX blocks of {MX_BLOCK} K/V features would otherwise "
                "straddle two heads (or key and value rows), which a rank rebuilding only its "
                f"heads quantizes apart. Use a multiple of {MX_BLOCK} or drop {FLAG}")

"""LAGA's K/V rebuild through the K/V module's own FP8 matmul (``--fp8-format``).

Under ``--transformer-impl transformer_engine --fp8-format ...`` MindSpeed builds
``linear_kv_up_proj`` (or ``linear_kv_nope``/``linear_v`` with ``--mla-mm-split``) as its
``TEColumnParallelLinear``, whose forward inside ``fp8_autocast`` quantizes the latent and
the weight with the recipe of the module's ``fp8_meta`` and multiplies them in FP8; its
backward quantizes the K/V gradient and multiplies it with the quantized weight (input
gradient) and the quantized latent (weight gradient). LAGA rebuilds K/V from the gathered
latent instead of calling the module, so :func:`kv_up_linear` hands the core
(``laga_attention(kv_up_linear=...)``) those same three FP8 matmuls, taken from MindSpeed
(``fp8_matmul``), on the rows of this rank's heads. With MX scaling (blocks of 32 along
the contraction, per token for the latent) quantizing the gathered latent gives each
token the values the host gives it at CP = 1, so K/V equal the host's bit for bit
(docs/INTEGRATION.md, section "FP8", has the measured comparison with a bf16 rebuild).

LoRA: peft wraps ``torch.nn.Linear`` and Megatron's ``ColumnParallelLinear`` /
``RowParallelLinear`` only and refuses MindSpeed's TE linears ("Target module ... is not
supported"), so under FP8 the K/V module is never LoRA-wrapped and its effective weight
(patches/lora.py) is its own weight; a wrapped FP8 module raises
``UnsupportedLoRAError`` naming it.

What the module's forward adds around the matmul is not repeated here: the tensor-parallel
all-reduce of the input gradient (the adapter's ``copy_to_tensor_model_parallel_region``
does it once for the latent), the bias (refused: ``--disable-bias-linear``) and MindSpeed's
fused accumulation into ``main_grad`` (the weight gradient is returned to autograd, which
Megatron adds to ``main_grad`` as for any parameter).
"""
from __future__ import annotations

import enum
import hashlib
import struct

import torch

from ..lora import UnsupportedLoRAError, base_layer, is_wrapped


def kv_up_linear(attention):
    """The up-projection LAGA calls for ``attention``'s K/V (``laga_attention``'s
    ``kv_up_linear``): its module's FP8 matmul when that module runs in FP8 now (MindSpeed's
    TE linear inside ``fp8_autocast``), else None (the core's ``F.linear``, what the module
    computes outside FP8)."""
    names = ("linear_kv_nope", "linear_v") if attention.mla_mm_split else ("linear_kv_up_proj",)
    modules = [getattr(attention, name) for name in names]
    fp8_meta = getattr(base_layer(modules[0]), "fp8_meta", None)
    if fp8_meta is None or not fp8_meta.is_fp8_enable():
        return None
    for name, module in zip(names, modules):
        if is_wrapped(module):
            raise UnsupportedLoRAError(
                f"{name} is a LoRA-wrapped FP8 linear ({type(module).__name__}): LAGA rebuilds "
                "K/V through the base layer's FP8 matmul and knows no adapter beside it (peft "
                "does not wrap MindSpeed's TE linears). Remove it from --lora-target-modules, "
                "or drop --fp8-format")
    def linear(latent, weight_rows, first_row):
        return FP8UpProjection.apply(latent, weight_rows, fp8_meta)

    linear.agreement_code = recipe_code(fp8_meta)  # the CP ranks agree on the FP8 recipe
    linear.agreement_tensors = lambda: held_scales(fp8_meta)  # and on its held scales
    return linear


def held_scales(fp8_meta) -> list:
    """The scales the recipe holds between calls (delayed scaling: the latent's and the
    weight's ``scale``), which a later call's in-band code hashes on the device. Block and
    MX scales are computed in the call from the gathered latent and the weight, alike on
    every rank; the gradient's scale follows each rank's own queries, so it is left out."""
    found = []
    for key in ("inputs", "weight"):
        scale = getattr(getattr(getattr(fp8_meta, key, None), "scale", None), "scale", None)
        if isinstance(scale, torch.Tensor):
            found.append(scale)
    return found


def recipe_code(fp8_meta) -> int:
    """The FP8 recipe (format, scaling, block size, ...) as a nonzero int64, from host facts
    only: what the CP ranks agree on for ``kv_up_linear`` (the scales themselves follow from
    the recipe and the latent, which every rank gathers alike)."""
    recipe = getattr(fp8_meta, "fp8_recipe", None)
    facts = vars(recipe) if hasattr(recipe, "__dict__") else {}
    simple = sorted((k, _fact(v)) for k, v in facts.items()
                    if isinstance(v, (bool, int, float, str, type(None), enum.Enum)))
    digest = hashlib.blake2b(repr((type(recipe).__name__, simple)).encode(), digest_size=8)
    return struct.unpack("<q", digest.digest())[0] or 1


def _fact(value) -> str:
    """A recipe field as text alike on every rank: an enum by its name (its value's repr
    may hold an object's address, which differs between processes)."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    return repr(value)


class FP8UpProjection(torch.autograd.Function):
    """``latent @ weight.T`` as MindSpeed's ``ColumnParallelNoSeq`` computes it in FP8
    (forward, input-gradient and weight-gradient matmuls), without its communication."""

    @staticmethod
    def forward(ctx, latent, weight, fp8_meta):
        from mindspeed.te.pytorch.fp8 import MatmulKey, fp8_matmul

        flat = latent.reshape(-1, latent.shape[-1])
        out, latent_fp8, weight_fp8 = fp8_matmul(flat, weight, fp8_meta, MatmulKey.forward)
        ctx.fp8_meta, ctx.latent_fp8, ctx.weight_fp8 = fp8_meta, latent_fp8, weight_fp8
        ctx.latent_shape = latent.shape
        return out.view(*latent.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        from mindspeed.te.pytorch.fp8 import MatmulKey, fp8_matmul

        grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_latent, grad_fp8, _ = fp8_matmul(grad, ctx.weight_fp8, ctx.fp8_meta, MatmulKey.dx)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight, _, _ = fp8_matmul(grad_fp8, ctx.latent_fp8, ctx.fp8_meta, MatmulKey.dw)
        ctx.latent_fp8 = ctx.weight_fp8 = None
        return grad_latent.view(ctx.latent_shape), grad_weight, None

"""The weight a possibly LoRA-wrapped linear applies: its base weight plus the LoRA delta.

LAGA rebuilds K/V from the K/V up-projection's *weight* instead of calling the
module, so a LoRA adapter on that module (peft's ``get_peft_model``, as
MindSpeed-LLM's ``--lora-target-modules`` applies it) would be skipped: a wrapped
layer's ``.weight`` is its base weight and the delta lives only in its forward.
:func:`effective_weight` returns what the forward multiplies by instead, as a
differentiable tensor, so the adapter's ``lora_A``/``lora_B`` get the gradients
the module's own forward gives them.

Only forwards read line by line are accepted, each named in ``_FORWARDS``; a
wrapped module with any other forward, or an option those forwards would apply
in a way a weight cannot express (dropout in training mode, DoRA, a LoRA bias, a
row-parallel base), raises :class:`UnsupportedLoRAError` naming the module's type before
anything is computed. On a module's first call the adapters read the weight after
the CP ranks met and send a rank's error in the same-weight exchange
(``patches.common.check_weight_once``), so a rank configured otherwise (dropout on
one rank only) makes every rank raise at once with its cause.

What the accepted forwards compute, for a column-parallel (or plain) base ``W``
and each active adapter ``a`` present in ``lora_A`` (``x``: the input):

- peft's ``Linear`` and ``LoraParallelLinear`` and MindSpeed-LLM's
  ``LoraParallelLinearMoE``: ``W x + sum_a scaling[a] * B_a (A_a dropout_a(x))``;
- CCLoRA (MindSpeed-LLM's ``--lora-fusion``, ``CCLoraParallelLinearForward``):
  ``(W + scaling[a] * B_a A_a) x`` for the *last* such adapter only (its loop
  overwrites the result), no dropout, and no gradient for ``W``;
- all: the base weight alone while adapters are disabled (unmerging first, as
  the forwards do) or once any adapter is merged into it.

Under tensor parallelism ``lora_B`` is column-parallel like the base, so
``B_a A_a`` already holds this TP rank's rows. Its input's gradient is what
``lora_A`` learns from: without sequence parallelism that gradient is
all-reduced over TP, so ``A_a`` enters through ``comm.sum_grad``; with
it, each rank's is a partial sum (the host marks ``lora_A`` ``sequence_parallel``
and Megatron sums it with the layer norms).
"""
from __future__ import annotations

import torch

from mindspeed_laga import comm

# (module, qualified name) of each forward whose arithmetic is mirrored here
PEFT = "peft"
CCLORA = "cclora"
_FORWARDS = {
    ("peft.tuners.lora.layer", "Linear.forward"): PEFT,
    ("peft.tuners.lora.tp_layer", "LoraParallelLinear.forward"): PEFT,
    ("mindspeed_llm.tasks.posttrain.lora.lora_moe", "LoraParallelLinearMoE.forward"): PEFT,
    ("mindspeed_llm.tasks.posttrain.lora.cc_lora_forward", "CCLoraParallelLinearForward"): CCLORA,
}


class UnsupportedLoRAError(RuntimeError):
    """A LoRA-wrapped linear whose forward LAGA cannot express as one weight."""


def is_wrapped(linear) -> bool:
    """True for a peft tuner layer (it keeps the original module as ``base_layer``)."""
    if isinstance(linear, torch.nn.Module):  # a submodule; a miss raises nothing (per call)
        return isinstance(linear._modules.get("base_layer"), torch.nn.Module)
    return isinstance(getattr(linear, "base_layer", None), torch.nn.Module)


def base_layer(linear):
    """The module a tuner layer wraps, or ``linear`` itself."""
    return linear.base_layer if is_wrapped(linear) else linear


def effective_weight(linear, name: str = "linear"):
    """``linear.weight``, or for a LoRA-wrapped linear the weight its forward applies.

    ``name``: how errors call the module (its attribute name in the attention)."""
    if not is_wrapped(linear):
        return linear.weight
    kind = forward_kind(linear, name)
    base = linear.base_layer.weight
    if linear.disable_adapters:
        if linear.merged:
            linear.unmerge()  # what the forward does first
        return base
    if linear.merged:
        return base
    adapters = [a for a in linear.active_adapters if a in linear.lora_A.keys()]
    if kind == CCLORA:
        if not adapters:
            raise UnsupportedLoRAError(
                f"{name} ({type(linear).__name__}, CCLoRA forward) has no active adapter with "
                "weights: its forward computes no output then. Activate an adapter or drop "
                "--lora-fusion")
        return base.detach() + _delta(linear, adapters[-1], cclora=True).to(base.dtype)
    weight = base
    for adapter in adapters:
        weight = weight + _delta(linear, adapter).to(base.dtype)
    return weight


def forward_kind(linear, name: str = "linear") -> str:
    """PEFT or CCLORA for a wrapped linear LAGA reads exactly; else UnsupportedLoRAError."""
    forward = type(linear).forward
    key = (getattr(forward, "__module__", None), getattr(forward, "__qualname__", None))
    kind = _FORWARDS.get(key)
    what = f"{name} is wrapped by {type(linear).__module__}.{type(linear).__qualname__}"
    if kind is None:
        known = ", ".join(f"{m}.{q}" for m, q in _FORWARDS)
        raise UnsupportedLoRAError(
            f"{what} with the forward {key[0]}.{key[1]}, which LAGA does not know: LAGA rebuilds "
            f"K/V from this module's weight and knows the LoRA arithmetic of {known} only. "
            f"Remove {name} from --lora-target-modules, or drop --mla-latent-all-gather")
    if is_wrapped(linear.base_layer):
        raise UnsupportedLoRAError(f"{what} around another adapter layer: nested adapters are "
                                   f"not read by LAGA; wrap {name} once, or drop "
                                   "--mla-latent-all-gather")
    if getattr(linear, "is_paralle_a", False) or getattr(linear, "is_parallel_a", False):
        raise UnsupportedLoRAError(f"{what} around a row-parallel base; LAGA reads a "
                                   f"column-parallel {name} only")
    for adapter in linear.active_adapters:
        _check_adapter(linear, adapter, kind, what)
    return kind


def _check_adapter(linear, adapter: str, kind: str, what: str) -> None:
    """Options of peft's LoRA that a weight W + s*B@A does not express."""
    def flag(attribute):
        value = getattr(linear, attribute, None)
        return bool(value.get(adapter)) if isinstance(value, dict) else False

    variants = {"use_dora": "DoRA (use_dora)", "lora_bias": "a LoRA bias (lora_bias)"}
    for attribute, label in variants.items():
        if flag(attribute):
            raise UnsupportedLoRAError(f"{what}: adapter {adapter!r} uses {label}, which LAGA "
                                       "cannot express as one weight; drop it or drop "
                                       "--mla-latent-all-gather")
    for attribute in ("lora_variant", "lora_magnitude_vector"):
        holder = getattr(linear, attribute, None)
        if holder is not None and adapter in holder:
            raise UnsupportedLoRAError(f"{what}: adapter {adapter!r} is a LoRA variant "
                                       f"({attribute}), which LAGA cannot express as one weight; "
                                       "use plain LoRA or drop --mla-latent-all-gather")
    if getattr(linear, "fan_in_fan_out", False):
        raise UnsupportedLoRAError(f"{what} with fan_in_fan_out=True (a transposed base weight); "
                                   "LAGA reads [out, in] weights only")
    dropout = linear.lora_dropout[adapter] if adapter in linear.lora_dropout else None
    # in eval mode the dropout passes its input through: the weight expresses that forward
    if kind == PEFT and dropout is not None and getattr(dropout, "p", 0.0) > 0 \
            and getattr(dropout, "training", True):
        raise UnsupportedLoRAError(
            f"{what}: adapter {adapter!r} has lora_dropout {dropout.p}, which drops inputs of "
            "the LoRA branch per token; a weight cannot express it. Use lora_dropout=0.0 (as "
            "MindSpeed-LLM does) or drop --mla-latent-all-gather")


def _delta(linear, adapter: str, cclora: bool = False):
    """scaling * B @ A: this TP rank's rows, with A's gradient summed over TP where the
    forward sums it (the input gradient of the column-parallel lora_B, or CCLoRA's)."""
    lora_a = linear.lora_A[adapter].weight
    lora_b = linear.lora_B[adapter].weight
    group = _grad_sum_group(linear, adapter, cclora)
    if group is not None:
        lora_a = comm.sum_grad(lora_a, group)
    return linear.scaling[adapter] * (lora_b @ lora_a)


def _grad_sum_group(linear, adapter: str, cclora: bool):
    """The TP group over which the forward all-reduces lora_A's input gradient, or None."""
    if cclora:  # cc_lora_forward.column_cc_lora_parallel_linear_forward's choice of function
        from megatron.core import parallel_state
        base = linear.base_layer
        if parallel_state.get_tensor_model_parallel_world_size() == 1:
            return None
        if getattr(base, "is_expert", False) or getattr(base, "sequence_parallel", False):
            return None
        return parallel_state.get_tensor_model_parallel_group()
    lora_b = linear.lora_B[adapter]
    # megatron's ColumnParallelLinear: TP > 1, no sequence parallelism, reduction not disabled
    if not getattr(lora_b, "allreduce_dgrad", False) or getattr(lora_b, "explicit_expert_comm",
                                                                 False):
        return None
    group = getattr(lora_b, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state
        group = parallel_state.get_tensor_model_parallel_group()
    return group

"""No silent no-op: with the flag on at CP > 1, the model each rank builds must hold an MLA
module LAGA patches, else every rank raises right after the model is built.

``LAGAFeature`` registers :func:`laga_model_check_wrapper` around Megatron's ``get_model``
(its name ends in ``wrapper``, so MindSpeed stacks it over other features' patches of
``get_model``). LAGA replaces only the forward of MindSpeed-LLM's ``CustomMLASelfAttention``
(and of its subclasses); a model whose attention is another class (DeepSeek-V4's
``DeepSeek4SelfAttention``, a non-MLA spec) would train unchanged with the flag on, so the
flag is refused there, naming the class found and why LAGA does not apply to it. Every rank
builds the same layer kinds and checks its own modules, so all of them raise, before the
first iteration's collectives; a rank holding no attention module at all (a pipeline stage
of only no-op layers) has nothing to check.
"""
from __future__ import annotations

import functools

from mindspeed_laga.features.laga_args import FLAG

MLA_CLASS = "CustomMLASelfAttention"
ATTENTION_SUFFIX = "SelfAttention"  # Megatron's, MindSpeed-LLM's and DeepSeek-V4's modules
# why LAGA has nothing to do in an attention class the flag may meet
WHY = {
    "DeepSeek4SelfAttention": (
        "DeepSeek-V4 attends over one shared compressed KV head, 512 wide, that its CP "
        "algorithm already gathers as it is: there are no per-head keys and values whose "
        "gather LAGA could replace by the latent's"),
}
DEFAULT_WHY = (f"LAGA replaces the forward of MindSpeed-LLM's {MLA_CLASS} (multi-latent "
               "attention) and of no other attention module")


def laga_model_check_wrapper(get_model):
    """Wrap Megatron's ``get_model``: the built model is checked by :func:`check_laga_applies`."""

    @functools.wraps(get_model)
    def get_model_checked(*args, **kwargs):
        model = get_model(*args, **kwargs)
        check_laga_applies(model)
        return model

    return get_model_checked


def _is_mla(module) -> bool:
    return any(cls.__name__ == MLA_CLASS for cls in type(module).__mro__)


def _why(cls) -> str:
    """The reason for ``cls`` or its nearest base named in WHY (V4's MTP attention is V4's)."""
    return next((WHY[base.__name__] for base in cls.__mro__ if base.__name__ in WHY), DEFAULT_WHY)


def check_laga_applies(model) -> None:
    """Raise ``ValueError`` when ``model`` (a module or a list of model chunks) has attention
    modules and none of them is one LAGA patches."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    modules = [module for chunk in chunks for module in chunk.modules()]
    if any(_is_mla(module) for module in modules):
        return
    found = {type(module).__name__: type(module) for module in modules
             if type(module).__name__.endswith(ATTENTION_SUFFIX)}
    if not found:
        return
    reasons = "; ".join(f"{name}: {_why(found[name])}" for name in sorted(found))
    raise ValueError(f"{FLAG} does not apply to this model: it has no {MLA_CLASS}, its attention "
                     f"is {', '.join(sorted(found))} ({reasons}). Drop {FLAG}: it would change nothing "
                     "in this model")

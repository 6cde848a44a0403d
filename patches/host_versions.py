"""Which host versions each patch was written for, checked before it touches a module.

A patch copies part of a host's forward, so a host that moved an attribute or
a function fails here with the supported versions named, not with an
AttributeError deep inside a training step. Extend the constants when a new
host version has passed the adapter tests.
"""
from __future__ import annotations

import inspect

# megatron-core releases the megatron-core patch (patches/megatron_core/mla.py) is tested with
SUPPORTED_MEGATRON_CORE = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")
# MindSpeed-LLM commits the MindSpeed-LLM patch (patches/mindspeed_llm/forward.py) is tested with
SUPPORTED_MINDSPEED_LLM = ("c77308a1",)

# what patches/megatron_core/mla.py calls in megatron-core, found by import
_MEGATRON_NEEDS = (
    ("megatron.core.models.common.embeddings.rope_utils", "_apply_rotary_pos_emb_bshd"),
    ("megatron.core.tensor_parallel.mappings", "gather_from_sequence_parallel_region"),
    ("megatron.core.tensor_parallel.mappings", "gather_from_tensor_model_parallel_region"),
    ("megatron.core.tensor_parallel.mappings", "scatter_to_sequence_parallel_region"),
    ("megatron.core.transformer.enums", "AttnMaskType"),
)
# the attributes of CustomMLASelfAttention the copied MindSpeed-LLM forward reads
MINDSPEED_LLM_MODULE_NEEDS = ("linear_qkv", "q_rank", "kv_lora_rank", "qk_pos_emb_head_dim",
                              "qk_head_dim", "v_head_dim", "q_head_dim", "kv_layernorm",
                              "q_layernorm", "mla_mm_split", "mla_scale_q_lora",
                              "mla_scale_kv_lora", "num_attention_heads_per_partition",
                              "linear_proj")


class UnsupportedHostError(RuntimeError):
    """The installed host differs from every version the patch was written for."""


def megatron_core_version() -> str:
    from megatron.core import package_info
    return package_info.__version__


def check_megatron_core(version: str = None) -> str:
    """Raise :class:`UnsupportedHostError` unless megatron-core is a supported release."""
    version = megatron_core_version() if version is None else version
    if version not in SUPPORTED_MEGATRON_CORE:
        raise UnsupportedHostError(
            f"mindspeed_laga.patch_megatron_mla supports megatron-core "
            f"{', '.join(SUPPORTED_MEGATRON_CORE)}; megatron-core {version} is installed. Install "
            f"a supported release (pip install 'mindspeed-laga[megatron]'); its MLA forward is "
            "copied, so another release may compute a different model")
    missing = [f"{mod}.{name}" for mod, name in _MEGATRON_NEEDS if not _importable(mod, name)]
    if missing:
        raise UnsupportedHostError(f"megatron-core {version} lacks {missing}, which "
                                   "mindspeed_laga.patch_megatron_mla calls; supported: "
                                   f"{', '.join(SUPPORTED_MEGATRON_CORE)}")
    return version


def _importable(module: str, name: str) -> bool:
    import importlib
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def _mindspeed_llm_message(what: str) -> str:
    return (f"--mla-latent-all-gather supports MindSpeed-LLM at commit "
            f"{', '.join(SUPPORTED_MINDSPEED_LLM)}: {what}. Releases 2.2.0 and 2.3.0 (no "
            "mla_scale_kv_lora, yarn rope de-interleaved inside the forward) are not supported; "
            "install the supported commit or drop --mla-latent-all-gather")


def check_mindspeed_llm_forward(forward) -> None:
    """At patch time: the wrapped ``CustomMLASelfAttention.forward`` reads
    ``mla_scale_kv_lora`` as the supported commit does.

    Only MindSpeed-LLM's own forward is read: another feature's wrapper without
    ``functools.wraps`` (or a forward without source) is left to the per-module
    check on the first LAGA call."""
    target = inspect.unwrap(forward)
    if not getattr(target, "__qualname__", "").endswith("MLASelfAttention.forward"):
        return
    try:
        source = inspect.getsource(target)
    except (OSError, TypeError):
        return
    if "mla_scale_kv_lora" not in source:
        raise UnsupportedHostError(_mindspeed_llm_message(
            "this CustomMLASelfAttention.forward does not apply mla_scale_kv_lora"))


def check_mindspeed_llm_module(module) -> None:
    """On a module's first LAGA call: the attributes the copied forward reads exist."""
    missing = [name for name in MINDSPEED_LLM_MODULE_NEEDS if not hasattr(module, name)]
    if missing:
        raise UnsupportedHostError(_mindspeed_llm_message(
            f"{type(module).__name__} has no {missing}"))

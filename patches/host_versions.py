"""Which host versions each patch was written for, checked before it touches a module.

A patch copies part of a host's forward, so a host that moved an attribute or
a function fails here with the supported versions named, not with an
AttributeError deep inside a training step. Extend the constants when a new
host version has passed the adapter tests.
"""
from __future__ import annotations

import inspect

from .mindspeed_llm_releases import (RELEASES, UnknownHostRelease, installed_release,
                                     release_of_forward, tested)

# megatron-core releases the megatron-core patch (patches/megatron_mla.py) is tested with
SUPPORTED_MEGATRON_CORE = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")
# MindSpeed-LLM releases the MindSpeed-LLM patch (patches/mindspeed_llm_mla.py) is tested
# with, each with its MindSpeed branch (patches/mindspeed_llm_releases.py tells them apart)
SUPPORTED_MINDSPEED_LLM = tuple(r.name for r in RELEASES)

# what patches/megatron_mla.py calls in megatron-core, found by import
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
                              "q_layernorm", "mla_mm_split", "num_attention_heads_per_partition",
                              "linear_proj")
# ...and on the releases that scale the latents (Release.lora_scales)
MINDSPEED_LLM_LORA_SCALES = ("mla_scale_q_lora", "mla_scale_kv_lora")


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
    return (f"--mla-latent-all-gather supports these MindSpeed-LLM releases: {tested()}. {what}. "
            "Install a tested pair or drop --mla-latent-all-gather")


def check_mindspeed_llm_release():
    """Before training (feature validation): the importable MindSpeed-LLM and MindSpeed
    are a tested pair; returns its ``Release``. Raises :class:`UnsupportedHostError`
    naming the tested releases otherwise."""
    try:
        return installed_release()
    except UnknownHostRelease as exc:
        raise UnsupportedHostError(_mindspeed_llm_message(str(exc))) from exc


def check_mindspeed_llm_forward(forward):
    """At patch time: the release whose ``CustomMLASelfAttention.forward`` is wrapped,
    read from the module that defines it.

    Only MindSpeed-LLM's own forward is read: another feature's wrapper without
    ``functools.wraps`` (or a forward without source) returns None, and the
    module's class names the release on its first LAGA call."""
    target = inspect.unwrap(forward)
    if not getattr(target, "__qualname__", "").endswith("MLASelfAttention.forward"):
        return None
    try:
        if inspect.getsourcefile(target) is None:
            return None
    except TypeError:
        return None
    try:
        return release_of_forward(target)
    except UnknownHostRelease as exc:
        raise UnsupportedHostError(_mindspeed_llm_message(str(exc))) from exc


def release_of_module(module):
    """When the patch could not tell (another feature wrapped the forward first): the
    release of the module defining the class."""
    from .mindspeed_llm_releases import identify_mindspeed_llm
    try:
        return identify_mindspeed_llm(inspect.getsourcefile(type(module)))
    except (TypeError, UnknownHostRelease) as exc:
        raise UnsupportedHostError(_mindspeed_llm_message(
            f"{type(module).__name__} is not a tested MindSpeed-LLM class ({exc})")) from exc


def check_mindspeed_llm_module(module, release) -> None:
    """On a module's first LAGA call: the attributes the forward reads on ``release`` exist."""
    needs = MINDSPEED_LLM_MODULE_NEEDS + (MINDSPEED_LLM_LORA_SCALES if release.lora_scales else ())
    missing = [name for name in needs if not hasattr(module, name)]
    if missing:
        raise UnsupportedHostError(_mindspeed_llm_message(
            f"{type(module).__name__} has no {missing}, which MindSpeed-LLM {release.name} "
            "defines"))

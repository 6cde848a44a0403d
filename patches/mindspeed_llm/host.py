"""The MindSpeed-LLM releases the MindSpeed-LLM patch was written for, checked before
training and before the patch touches a module.

The release itself is told from the host's source (``releases.py``); these checks turn
an unknown host into :class:`UnsupportedHostError` naming the tested releases, and make
sure a module has every attribute the forward reads on its release.
"""
from __future__ import annotations

import inspect

from ..common import UnsupportedHostError
from .releases import (RELEASES, UnknownHostRelease, identify_mindspeed_llm, installed_release,
                       release_of_forward, tested)

# MindSpeed-LLM releases the MindSpeed-LLM patch (patches/mindspeed_llm/forward.py) is tested
# with, each with its MindSpeed branch (releases.py tells them apart)
SUPPORTED_MINDSPEED_LLM = tuple(r.name for r in RELEASES)

# the attributes of CustomMLASelfAttention the copied MindSpeed-LLM forward reads
MINDSPEED_LLM_MODULE_NEEDS = ("linear_qkv", "q_rank", "kv_lora_rank", "qk_pos_emb_head_dim",
                              "qk_head_dim", "v_head_dim", "q_head_dim", "kv_layernorm",
                              "q_layernorm", "mla_mm_split", "num_attention_heads_per_partition",
                              "linear_proj")
# ...and on the releases that scale the latents (Release.lora_scales)
MINDSPEED_LLM_LORA_SCALES = ("mla_scale_q_lora", "mla_scale_kv_lora")


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

"""The megatron-core releases the megatron-core patch was written for, checked before it
touches a module.

The patch copies part of ``MLASelfAttention``'s forward, so a release that moved an
attribute or a function fails here with the supported releases named, not with an
AttributeError deep inside a training step. Extend the constant when a new release has
passed the adapter tests.
"""
from __future__ import annotations

from ..common import UnsupportedHostError

# megatron-core releases the megatron-core patch (patches/megatron_core/mla.py) is tested with
SUPPORTED_MEGATRON_CORE = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")
# what patches/megatron_core/mla.py calls in megatron-core, found by import
_MEGATRON_NEEDS = (
    ("megatron.core.models.common.embeddings.rope_utils", "_apply_rotary_pos_emb_bshd"),
    ("megatron.core.tensor_parallel.mappings", "gather_from_sequence_parallel_region"),
    ("megatron.core.tensor_parallel.mappings", "gather_from_tensor_model_parallel_region"),
    ("megatron.core.tensor_parallel.mappings", "scatter_to_sequence_parallel_region"),
    ("megatron.core.transformer.enums", "AttnMaskType"),
)

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

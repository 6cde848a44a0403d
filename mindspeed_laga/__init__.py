"""mindspeed-laga: Latent All-Gather Attention for MLA under context parallelism."""
from ._versions import check_torch, installed_torch_version
from .lazy import lazy

# Before any module of the package meets an untested torch; read from the installed
# metadata, so that importing the package (the CLI parsing its arguments, ``--help``)
# does not import torch itself. The names below import it on first use.
check_torch(installed_torch_version())

_API = {"FORMS": ".api", "absorbed_attention": ".api", "explicit_attention": ".api",
        "laga_attention": ".api", "CommCounter": ".comm", "count_bytes": ".comm",
        "LatentGather": ".forms.latent_source", "start_latent_gather": ".forms.latent_source",
        "mla_attention_reference": ".reference",
        "SparseResult": ".sparse.form", "sparse_laga_attention": ".sparse.form",
        "new_micro_batch": ".agreement", "settle": ".agreement"}
_LAZY = lazy(__name__, _API)


def __getattr__(name):
    if name == "handshake":  # the agreement's name before it became a package
        from . import agreement
        return agreement
    return _LAZY(name)

__version__ = "0.1.0"

__all__ = ["laga_attention", "explicit_attention", "absorbed_attention", "FORMS",
           "count_bytes", "CommCounter", "start_latent_gather", "LatentGather", "mla_attention_reference",
           "sparse_laga_attention", "SparseResult", "new_micro_batch", "settle",
           "patch_megatron_mla", "unpatch_megatron_mla"]


# The megatron-core adapter lives in mindspeed_laga.patches; these two convenience
# entry points import it on call, so importing the core never imports an adapter.

def patch_megatron_mla(*args, **kwargs):
    """Route megatron-core's MLASelfAttention through LAGA (see patches/megatron_core/patch.py)."""
    from .patches.megatron_core.patch import patch_megatron_mla as _patch
    return _patch(*args, **kwargs)


def unpatch_megatron_mla():
    """Restore megatron-core's original MLASelfAttention.forward."""
    from .patches.megatron_core.patch import unpatch_megatron_mla as _unpatch
    return _unpatch()

"""mindspeed-laga: Latent All-Gather Attention for MLA under context parallelism."""
from ._versions import check_torch

check_torch()  # before the modules below meet an untested torch

from .api import FORMS, absorbed_attention, explicit_attention, laga_attention
from .comm import CommCounter, count_bytes
from .forms.latent_source import LatentGather, start_latent_gather
from .forms.sparse_mla import SparseResult, sparse_laga_attention
from .reference import mla_attention_reference

__version__ = "0.1.0"

__all__ = ["laga_attention", "explicit_attention", "absorbed_attention", "FORMS",
           "count_bytes", "CommCounter", "start_latent_gather", "LatentGather", "mla_attention_reference",
           "sparse_laga_attention", "SparseResult",
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

"""Every attention path a test sweeps, by name: LAGA (plain, trimming the causal prefix,
recomputing K/V by segment and by key block), explicit and absorbed."""
from __future__ import annotations

from mindspeed_laga import absorbed_attention, explicit_attention, laga_attention


def attention_variants(kv_block_size: int) -> dict:
    """{name: (form, its keyword options)}; ``kv_block_size``: the blockwise rebuild's block,
    chosen by the test against its sequence length."""
    return {
        "laga": (laga_attention, {}),
        "laga+trim": (laga_attention, {"trim_causal_prefix": True}),
        "laga+recompute": (laga_attention, {"recompute_kv": True}),
        "laga+blockwise": (laga_attention, {"recompute_kv": True, "kv_block_size": kv_block_size}),
        "explicit": (explicit_attention, {}),
        "absorbed": (absorbed_attention, {}),
    }

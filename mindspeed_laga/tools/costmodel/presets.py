"""The model presets of ``plan --preset``, ``plan --dsa`` and ``bench --dsa``: the one list.

Each preset declares the MindSpeed-LLM pretrain recipe its dims come from (a path under
the host's ``examples/mcore/``; the preset test reads the recipe's flags against it), or
``recipe=None`` with ``no_recipe`` saying why there is none. A sparse (DSA) model also
declares its indexer, and a model whose layers share picks its :class:`IndexShare`; a model
LAGA covers on MindSpeed-LLM's FSDP2 backend, its HF ``model_type``.
Adding a preset: one ``Preset`` line in ``MODELS``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ...vocab.dims import ModelDims
from .model_dims import IndexerDims, IndexShare


@dataclass(frozen=True)
class Preset:
    dims: ModelDims
    recipe: Optional[str]          # the host recipe, relative to examples/mcore/
    no_recipe: str = ""            # why there is none (recipe None)
    indexer: Optional[IndexerDims] = None   # sparse MLA (DSA): the lightning indexer
    share: Optional[IndexShare] = None      # layers that reuse an earlier layer's picks
    hf_model_type: Optional[str] = None     # config.json's model_type LAGA covers on FSDP2

    def __post_init__(self):
        if (self.recipe is None) == (not self.no_recipe):
            raise TypeError("a preset declares its recipe, or (recipe=None) why it has none")

    @property
    def sparse(self) -> bool:
        return self.indexer is not None


# ModelDims(heads, qk_head_dim, rope_dim, v_head_dim, kv_lora_rank, hidden_size, q_lora_rank);
# q_lora_rank None: the query is projected straight from the hidden state.
_GLM5 = ModelDims(64, 192, 64, 256, 512, 6144, 2048)
MODELS: Dict[str, Preset] = {
    "deepseek-v3": Preset(ModelDims(128, 128, 64, 128, 512, 7168, 1536),
                          "deepseek3/pretrain_deepseek3_671b_4k_ptd.sh", hf_model_type="deepseek_v3"),
    "deepseek-v2-lite": Preset(ModelDims(16, 128, 64, 128, 512, 2048, None),
                               "deepseek2_lite/pretrain_deepseek2_lite_16b_ptd_8p.sh"),
    "kimi-k2": Preset(ModelDims(64, 128, 64, 128, 512, 7168, 1536),
                      "kimi2/pretrain_kimi2_18b_4k_8p_ptd.sh"),
    "longcat-flash": Preset(ModelDims(64, 128, 64, 128, 512, 6144, 1536),
                            "longcat/pretrain_longcat_flash_560b_4k_A3_ptd.sh"),
    "plm": Preset(ModelDims(16, 128, 64, 128, 512, 2048, None), "plm/pretrain_plm_1point8b_ptd.sh"),
    "minicpm3": Preset(ModelDims(40, 64, 32, 64, 256, 2560, 768),
                       "minicpm3/pretrain_minicpm3_4b_32k_ptd.sh"),
    "deepseek-v3.2": Preset(ModelDims(128, 128, 64, 128, 512, 7168, 1536),
                            "deepseek32/pretrain_deepseek32_671b_4k_A3_ptd.sh",
                            indexer=IndexerDims(64, 128)),
    "glm-5": Preset(_GLM5, "glm5/pretrain_glm5_744b_4k_A3_ptd.sh", indexer=IndexerDims(32, 128),
                    hf_model_type="glm_moe_dsa"),
    "glm-5.2": Preset(_GLM5, "glm52/pretrain_glm52_744b_4k_A3_ptd.sh", indexer=IndexerDims(32, 128),
                      share=IndexShare(freq=4, offset=3, num_layers=78), hf_model_type="glm_moe_dsa"),
}
# What the dense and the sparse commands each read of it.
PRESETS: Dict[str, ModelDims] = {n: p.dims for n, p in MODELS.items() if not p.sparse}
DSA_PRESETS: Dict[str, Tuple[ModelDims, IndexerDims]] = {
    n: (p.dims, p.indexer) for n, p in MODELS.items() if p.sparse}
DSA_SHARES: Dict[str, IndexShare] = {n: p.share for n, p in MODELS.items() if p.share}
# The models of MindSpeed-LLM's FSDP2 backend LAGA covers: preset -> config.json's model_type.
FSDP2_MODELS: Dict[str, str] = {n: p.hf_model_type for n, p in MODELS.items() if p.hf_model_type}


def preset(name: str) -> ModelDims:
    """A dense preset's dims; a sparse model's name points to --dsa."""
    if name in DSA_PRESETS:
        raise ValueError(f"--preset {name}: {name} is a sparse (DSA) model; use --dsa {name}")
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; use one of {sorted(PRESETS)} or give the "
                         f"dims (sparse models: --dsa {'/'.join(sorted(DSA_PRESETS))})")
    return PRESETS[name]


def dsa_preset(name: str) -> Tuple[ModelDims, IndexerDims]:
    if name not in DSA_PRESETS:
        raise ValueError(f"unknown DSA model {name!r}; use one of {sorted(DSA_PRESETS)}")
    return DSA_PRESETS[name]

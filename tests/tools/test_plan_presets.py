"""The model presets carry the dims MindSpeed-LLM's own recipes train them with.

Every preset of the registry (``costmodel/presets.py``) declares its recipe or why it has
none; each declared recipe is read as bash expands it (tests/support/recipes.py) in the
master host sources, and the preset's MLA dims, a sparse model's indexer heads and a
sharing model's layer mix are compared with its flags.
"""
from pathlib import Path

import pytest

from mindspeed_laga.tools.costmodel.presets import MODELS, Preset
from mindspeed_laga.vocab.dims import ModelDims
from support.recipes import recipe_argv

MCORE = Path("examples") / "mcore"
# ModelDims field -> the recipe flag that sets it
FLAGS = {"heads": "--num-attention-heads", "qk_head_dim": "--qk-head-dim",
         "rope_dim": "--qk-pos-emb-head-dim", "v_head_dim": "--v-head-dim",
         "kv_lora_rank": "--kv-lora-rank", "hidden_size": "--hidden-size",
         "q_lora_rank": "--q-lora-rank"}
WITH_RECIPE = [name for name, p in MODELS.items() if p.recipe]


def test_every_preset_has_its_recipe():
    """A preset names its recipe or says why it has none (the registry refuses neither)."""
    for name, p in MODELS.items():
        assert p.recipe or p.no_recipe, name
    with pytest.raises(TypeError, match="declares its recipe"):
        Preset(ModelDims(1, 1, 1, 1, 1, 1, None), None)


def _flag(argv, flag):
    return int(argv[argv.index(flag) + 1]) if flag in argv else None


@pytest.mark.parametrize("name", WITH_RECIPE)
def test_preset_dims_equal_the_recipe_flags(host_sources, name):
    p = MODELS[name]
    argv, _ = recipe_argv(Path(host_sources["MINDSPEED_LLM_SRC"]) / MCORE / p.recipe)
    assert "--multi-latent-attention" in argv
    for field, flag in FLAGS.items():
        assert getattr(p.dims, field) == _flag(argv, flag), (name, flag)  # no q-lora: None
    if p.sparse:
        # unstated: the host's defaults (dsa_indexer_feature.py: 64 heads of 128)
        assert (p.indexer.heads, p.indexer.head_dim) == (
            _flag(argv, "--index-n-heads") or 64, _flag(argv, "--index-head-dim") or 128), name
    if p.share is not None:
        assert (p.share.freq, p.share.offset, p.share.num_layers) == (
            _flag(argv, "--index-topk-freq"), _flag(argv, "--index-skip-topk-offset"),
            _flag(argv, "--num-layers")), name
    else:
        assert "--index-topk-freq" not in argv, name

"""``plan --preset``'s MLA families carry the dims MindSpeed-LLM's own recipes train them with.

Each preset is compared with the flags of the family's stock pretrain script in the
master host sources, read as bash expands it (tests/support/recipes.py).
"""
from pathlib import Path

import pytest

from mindspeed_laga.tools import costmodel as cm
from support.recipes import recipe_argv

MCORE = Path("examples") / "mcore"
# preset -> the recipe it comes from
RECIPES = {
    "deepseek-v3": MCORE / "deepseek3" / "pretrain_deepseek3_671b_4k_ptd.sh",
    "deepseek-v2-lite": MCORE / "deepseek2_lite" / "pretrain_deepseek2_lite_16b_ptd_8p.sh",
    "kimi-k2": MCORE / "kimi2" / "pretrain_kimi2_18b_4k_8p_ptd.sh",
    "longcat-flash": MCORE / "longcat" / "pretrain_longcat_flash_560b_4k_A3_ptd.sh",
    "plm": MCORE / "plm" / "pretrain_plm_1point8b_ptd.sh",
    "minicpm3": MCORE / "minicpm3" / "pretrain_minicpm3_4b_32k_ptd.sh",
}
# ModelDims field -> the recipe flag that sets it
FLAGS = {"heads": "--num-attention-heads", "qk_head_dim": "--qk-head-dim",
         "rope_dim": "--qk-pos-emb-head-dim", "v_head_dim": "--v-head-dim",
         "kv_lora_rank": "--kv-lora-rank", "hidden_size": "--hidden-size",
         "q_lora_rank": "--q-lora-rank"}


def test_every_preset_has_its_recipe():
    assert sorted(RECIPES) == sorted(cm.PRESETS)


@pytest.mark.parametrize("name", list(RECIPES))
def test_preset_dims_equal_the_recipe_flags(host_sources, name):
    argv, _ = recipe_argv(Path(host_sources["MINDSPEED_LLM_SRC"]) / RECIPES[name])
    assert "--multi-latent-attention" in argv
    for field, flag in FLAGS.items():
        stated = int(argv[argv.index(flag) + 1]) if flag in argv else None  # no q-lora: None
        assert getattr(cm.preset(name), field) == stated, (name, flag)

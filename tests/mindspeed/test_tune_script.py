"""scripts/tune_deepseek3_laga.sh, dry-run: with LAGA=0 it is MindSpeed-LLM's stock CP
fine-tuning recipe (tune_deepseek3_671b_16k_lora_A3_ptd.sh) flag for flag; the LAGA=1
toggle changes exactly the launcher and LAGA's flags, and the flags it passes satisfy
LAGAFeature's checks for every mapped CP algorithm, padded and packed."""
from pathlib import Path

import pytest
from support.laga_scripts import LagaScript
from support.laga_scripts import flags as parse_flags

SCRIPT = LagaScript("tune_deepseek3_laga.sh", "posttrain_gpt.py")
dry_run, script_args, validate = SCRIPT.dry_run, SCRIPT.args, SCRIPT.validate
STOCK = "tune_deepseek3_671b_16k_lora_A3_ptd.sh"


def test_laga_toggle_adds_launcher_and_flags_only():
    SCRIPT.assert_toggle_adds_launcher_and_flags_only()


@pytest.mark.parametrize("cp_type", ["ulysses_cp_algo", "kvallgather_cp_algo", "megatron_cp_algo"])
@pytest.mark.parametrize("packed", ["0", "1"])
def test_script_flags_pass_laga_validation(cp_type, packed):
    args = validate(dry_run(LAGA="1", CP_TYPE=cp_type, PACKED=packed))
    assert args.mla_latent_all_gather and args.context_parallel_size == 2
    assert bool(args.reset_attention_mask) == (packed == "1") and args.micro_batch_size == 1


def test_sft_toggles():
    flags = parse_flags(script_args(dry_run(PADDING_SIDE="left", PACKED="1",
                                       LORA_TARGETS="linear_qkv linear_kv_up_proj")))
    assert flags["--tokenizer-padding-side"] == [["left"]]
    assert flags["--reset-attention-mask"] == [[]]
    assert flags["--lora-target-modules"] == [["linear_qkv", "linear_kv_up_proj"]]


PATH_FLAGS = ("--save", "--load", "--data-path", "--tokenizer-name-or-path")


def test_without_laga_it_is_the_stock_recipe(host_sources):
    from support.recipes import RECIPE_DIR, recipe_argv

    stock, world = recipe_argv(Path(host_sources["MINDSPEED_LLM_SRC"]) / RECIPE_DIR / STOCK,
                               entry="posttrain_gpt.py")
    stock = parse_flags(stock)
    ours = parse_flags(script_args(dry_run(LAGA="0")))
    for flag in PATH_FLAGS:
        assert len(stock.pop(flag)) == len(ours.pop(flag)) == 1, flag
    assert ours == stock
    assert world == 16 * 8  # the same nodes as the script's defaults

"""scripts/pretrain_deepseek3_laga.sh, dry-run: at CP=1 and LAGA=0 it is MindSpeed-LLM's
stock DeepSeek-V3 recipe flag for flag; the LAGA=1 toggle changes exactly the launcher
and LAGA's flags, and the flags it passes satisfy LAGAFeature's checks."""
import subprocess
from pathlib import Path

import pytest
from support.laga_scripts import LagaScript
from support.laga_scripts import flags as parse_flags

SCRIPT = LagaScript("pretrain_deepseek3_laga.sh", "pretrain_gpt.py")
dry_run, script_args, validate = SCRIPT.dry_run, SCRIPT.args, SCRIPT.validate


def test_laga_toggle_adds_launcher_and_flags_only():
    SCRIPT.assert_toggle_adds_launcher_and_flags_only()


@pytest.mark.parametrize("cp_type", ["kvallgather_cp_algo", "ulysses_cp_algo", "megatron_cp_algo"])
def test_script_flags_pass_laga_validation(cp_type):
    args = validate(dry_run(LAGA="1", CP_TYPE=cp_type))
    assert args.mla_latent_all_gather and args.context_parallel_size == 2
    assert args.reset_attention_mask and args.micro_batch_size == 1  # packed, as upstream


def test_hybrid_runs_unpacked_and_packed_hybrid_is_caught():
    """The script refuses packed hybrid itself, before launching what the feature refuses."""
    unpacked = dry_run(LAGA="1", CP="4", CP_TYPE="hybrid_cp_algo", ULYSSES_DEGREE="2", RESET_MASK="0")
    args = validate(unpacked)
    assert args.ulysses_degree_in_cp == 2 and not args.reset_attention_mask
    with pytest.raises(ValueError, match="hybrid_cp_algo and --reset-attention-mask"):
        validate(unpacked + ["--reset-attention-mask"])
    with pytest.raises(subprocess.CalledProcessError) as refused:
        dry_run(LAGA="1", CP="4", CP_TYPE="hybrid_cp_algo", ULYSSES_DEGREE="2")
    assert "hybrid_cp_algo with packed documents (RESET_MASK=1)" in refused.value.stderr


PATH_FLAGS = ("--save", "--load", "--data-path", "--tokenizer-name-or-path")


def test_without_cp_and_laga_it_is_the_stock_recipe(host_sources):
    from support.recipes import RECIPE_DIR, RECIPES, recipe_argv

    stock, _world = recipe_argv(Path(host_sources["MINDSPEED_LLM_SRC"]) / RECIPE_DIR / RECIPES[0],
                                "ulysses_cp_algo")
    stock = parse_flags(stock)
    ours = parse_flags(script_args(dry_run(LAGA="0", CP="1")))
    for flag in PATH_FLAGS:
        assert len(stock.pop(flag)) == len(ours.pop(flag)) == 1, flag
    assert ours == stock


def test_with_cp_only_the_dualpipe_group_goes():
    at_cp1, at_cp2 = parse_flags(script_args(dry_run(LAGA="0", CP="1"))), parse_flags(
        script_args(dry_run(LAGA="0")))
    gone = set(at_cp1) - set(at_cp2)
    assert gone == {"--schedules-method", "--moe-fb-overlap"} and not set(at_cp2) - set(at_cp1)


def test_option_toggles_reach_the_feature():
    from mindspeed_laga.features.laga_args import laga_settings
    args = validate(dry_run(LAGA="1", LAGA_RECOMPUTE="1", LAGA_BLOCK="2048", LAGA_TRIM="1",
                            LAGA_OVERLAP="1"))
    settings = laga_settings(args)
    assert (settings.recompute_kv, settings.kv_block_size, settings.trim_causal_prefix,
            settings.overlap) == (True, 2048, True, True)
    plain = laga_settings(validate(dry_run(LAGA="1")))
    assert (plain.recompute_kv, plain.kv_block_size, plain.trim_causal_prefix, plain.overlap) == (
        False, None, False, False)

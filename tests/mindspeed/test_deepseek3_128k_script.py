"""scripts/pretrain_deepseek3_128k_laga.sh, dry-run: with LAGA=0 it is MindSpeed-LLM's own
DeepSeek-V3 128k recipe (master, tests/poc/deepseek3_671b_64p_perf, bf16) flag for flag;
the LAGA=1 toggle changes exactly the launcher and LAGA's flags."""
from pathlib import Path

from support.laga_scripts import LagaScript
from support.laga_scripts import flags as parse_flags

SCRIPT = LagaScript("pretrain_deepseek3_128k_laga.sh", "pretrain_gpt.py")
RECIPE = Path("tests") / "poc" / "deepseek3_671b_64p_perf" / "pretrain_deepseek3_75.9b_128k_bf16_A5_ptd.sh"
PATH_FLAGS = ("--save", "--load", "--data-path", "--tokenizer-name-or-path")


def test_laga_toggle_adds_launcher_and_flags_only():
    SCRIPT.assert_toggle_adds_launcher_and_flags_only()


def test_without_laga_it_is_the_hosts_128k_recipe(host_sources):
    from support.recipes import recipe_argv

    stock, world = recipe_argv(Path(host_sources["MINDSPEED_LLM_SRC"]) / RECIPE)
    stock = parse_flags(stock)
    ours = parse_flags(SCRIPT.args(SCRIPT.dry_run(LAGA="0")))
    for flag in PATH_FLAGS:
        assert len(stock.pop(flag)) == len(ours.pop(flag)) == 1, flag
    assert ours == stock
    assert world == 64 and ours["--context-parallel-size"] == [["8"]]
    assert ours["--attention-mask-type"] == [["general"]] and ours["--seq-length"] == [["131072"]]

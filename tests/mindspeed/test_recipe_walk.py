"""Every MLA recipe MindSpeed-LLM master ships with CP > 1 (``examples/mcore/`` and its own
``tests/poc/``), with ``--mla-latent-all-gather`` added: it validates, or it is refused
with a reason docs/INTEGRATION.md lists ("Every MindSpeed-LLM MLA recipe with CP").

The walk finds the recipes itself (each script that sets ``--multi-latent-attention`` and,
as its own bash expands it, ``--context-parallel-size`` > 1), so a recipe the host adds
fails here until it has a row in EXPECTED (GLM-5.2's recipes, shipped at CP 1, are walked
at CP 2 and 4: RESIZED). Each recipe runs as shipped, at its own CP size
and algorithm, through Megatron core_v0.12.1's ``parse_args``, MindSpeed-LLM's argument
pipeline and validation (LAGAFeature last in its features list), as
tests/mindspeed/test_stock_recipe.py runs the DeepSeek-V3 4k recipes; the only changes:
placeholder paths become empty folders and ``--enable-hf2mg-convert`` is left out (see
_walked_argv).

Run in one subprocess: ``python tests/mindspeed/test_recipe_walk.py`` prints the outcome of
every recipe.
"""
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]  # for support/, also when run as a script
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
from support.recipes import recipe_argv  # noqa: E402

LAGA = "--mla-latent-all-gather"
WHERE = ("examples/mcore/*/*.sh", "tests/poc/*/*.sh")
ENTRIES = ("pretrain_gpt.py", "posttrain_gpt.py", "pretrain_deepseek4.py")

# the refusals, as LAGA words them (docs/INTEGRATION.md lists each)
# sparse MLA runs the host's DSA paths, fused ops included; compressed KV (V4) is refused
KV_COMPRESS = "--mla-latent-all-gather with --enable-dsa-indexer and --kv-compress is not supported"
OK = "ok"
HOST = "host: "  # the host refuses the recipe itself, LAGA aside
V3 = "tests/poc/deepseek3_671b_"
LONGCAT = "tests/poc/longcat_flash_chat"
# recipe -> OK, or a substring of the refusal it meets first
EXPECTED = {
    "examples/mcore/deepseek3/tune_deepseek3_671b_16k_lora_A3_ptd.sh": OK,
    "examples/mcore/deepseek32/tune_deepseek32_671b_16K_A3_full_ptd.sh": OK,
    "examples/mcore/deepseek4_flash/pretrain_deepseek4_flash_128k_A3_ptd.sh": KV_COMPRESS,
    "examples/mcore/minicpm3/pretrain_minicpm3_4b_32k_ptd.sh": OK,
    "tests/poc/deepseek32/tune_deepseek32_671b_cut_128k_A3_ptd.sh": OK,
    V3 + "64p_perf/pretrain_deepseek3_16.2b_256k_bf16_A5_ptd.sh": OK,
    V3 + "64p_perf/pretrain_deepseek3_16.2b_256k_fp8_A5_ptd.sh": OK,
    V3 + "64p_perf/pretrain_deepseek3_75.9b_128k_bf16_A5_ptd.sh": OK,
    # a stray "\s" after --hidden-dropout 0.0 in the script: Megatron's parser stops it
    V3 + "64p_perf/pretrain_deepseek3_75.9b_128k_fp8_A5_ptd.sh":
        HOST + "pretrain_gpt.py: error: unrecognized arguments: \\s",
    V3 + "8p_acc/pretrain_deepseek3_0.3b_256k_bf16_A5_ptd.sh": OK,
    V3 + "8p_acc/pretrain_deepseek3_0.3b_256k_fp8_A5_ptd.sh": OK,
    V3 + "8p_acc/pretrain_deepseek3_0.9b_128k_bf16_A5_ptd.sh": OK,
    V3 + "8p_acc/pretrain_deepseek3_0.9b_128k_fp8_A5_ptd.sh": OK,
    V3 + "8p_perf/pretrain_deepseek3_13.9b_128k_bf16_A5_ptd.sh": OK,
    V3 + "8p_perf/pretrain_deepseek3_13.9b_128k_fp8_A5_ptd.sh": OK,
    V3 + "8p_perf/pretrain_deepseek3_2.8b_256k_bf16_A5_ptd.sh": OK,
    V3 + "8p_perf/pretrain_deepseek3_2.8b_256k_fp8_A5_ptd.sh": OK,
    "tests/poc/deepseek4_flash/pretrain_deepseek4_flash_128k_A3_ptd.sh": KV_COMPRESS,
    "tests/poc/deepseek4_flash/pretrain_deepseek4_flash_7.8b_128k_A3_ptd.sh": KV_COMPRESS,
    LONGCAT + "/pretrain_longcat_flash_560b_128k_8die_A5_ptd.sh": OK,
    LONGCAT + "_64p_perf/pretrain_longcat_flash_9.9b_128k_bf16_A5_ptd.sh": OK,
    LONGCAT + "_64p_perf/pretrain_longcat_flash_9.9b_128k_fp8_A5_ptd.sh": OK,
    LONGCAT + "_64p_perf/pretrain_longcat_flash_9.9b_256k_bf16_A5_ptd.sh": OK,
    LONGCAT + "_64p_perf/pretrain_longcat_flash_9.9b_256k_fp8_A5_ptd.sh": OK,
    LONGCAT + "_8p_acc/pretrain_longcat_flash_0.3b_128k_bf16_A5_ptd.sh": OK,
    LONGCAT + "_8p_acc/pretrain_longcat_flash_0.3b_128k_fp8_A5_ptd.sh": OK,
    LONGCAT + "_8p_acc/pretrain_longcat_flash_0.3b_256k_bf16_A5_ptd.sh": OK,
    LONGCAT + "_8p_acc/pretrain_longcat_flash_0.3b_256k_fp8_A5_ptd.sh": OK,
    LONGCAT + "_8p_perf/pretrain_longcat_flash_0.2b_256k_bf16_A5_ptd.sh": OK,
    LONGCAT + "_8p_perf/pretrain_longcat_flash_0.2b_256k_fp8_A5_ptd.sh": OK,
    LONGCAT + "_8p_perf/pretrain_longcat_flash_2.4b_128k_bf16_A5_ptd.sh": OK,
    LONGCAT + "_8p_perf/pretrain_longcat_flash_2.4b_128k_fp8_A5_ptd.sh": OK,
}

# recipes shipped at CP 1 whose model LAGA is meant to run under CP (GLM-5.2's shared
# picks): walked as shipped but for --context-parallel-size, at each size here
RESIZED = {"examples/mcore/glm52/pretrain_glm52_744b_4k_A3_ptd.sh": (2, 4),
           "tests/poc/glm52/pretrain_glm52_32B_4k_A5_ptd.sh": (2, 4)}
EXPECTED.update({f"{recipe} at CP {cp}": OK for recipe, sizes in RESIZED.items()
                 for cp in sizes})


def _entry(text: str):
    return next((entry for entry in ENTRIES if entry in text), None)


def _value(argv, flag, default="1"):
    positions = [i for i, token in enumerate(argv) if token == flag]
    return argv[positions[-1] + 1] if positions else default


def cp_recipes(llm_src: Path, dummies: Path = Path("/dummy")) -> dict:
    """{recipe path: (its pretrain_gpt.py-style arguments, world size)} for every MLA
    training script that ships CP > 1 (generate/evaluate scripts have no training entry)."""
    found = {}
    for script in sorted(p for pattern in WHERE for p in Path(llm_src).glob(pattern)):
        text = script.read_text()
        entry = _entry(text)
        if "--multi-latent-attention" not in text or entry is None:
            continue
        argv, world = recipe_argv(script, dummies=dummies, entry=entry)
        recipe = str(script.relative_to(llm_src))
        if int(_value(argv, "--context-parallel-size")) > 1:
            found[recipe] = (argv, world)
        for cp in RESIZED.get(recipe, ()):  # the last --context-parallel-size wins
            found[f"{recipe} at CP {cp}"] = (argv + ["--context-parallel-size", str(cp)], world)
    return found


def _walked_argv(argv, dummies: Path):
    """The recipe's arguments as validated: every placeholder path an empty folder (MindSpeed
    checks that the tokenizer's exists), --enable-hf2mg-convert left out (it converts a
    Hugging Face checkpoint at load time, which needs its config.json, and has nothing to do
    with attention or CP), the flag added."""
    for token in argv:
        if token.startswith(str(dummies) + "/"):
            Path(token).mkdir(parents=True, exist_ok=True)
    return [token for token in argv if token != "--enable-hf2mg-convert"] + [LAGA]


def validate_all(llm_src: str) -> dict:
    """{recipe: "ok" or the error and where it was raised}: the real argument pipeline."""
    from support.mindspeed_llm_real import megatron_args, prepare

    prepare()
    import torch
    import torch_npu.npu  # the stand-in of mindspeed_llm_real.prepare

    # what the recipes' NPU features ask the device (an Atlas A3/A5 answers as capable)
    torch_npu.npu.get_device_name = lambda *a, **k: "Ascend910_9391"
    torch.cuda.get_device_capability = lambda *a, **k: (8, 0)
    dummies = Path(tempfile.mkdtemp(prefix="recipe-walk-"))
    results = {}
    for recipe, (argv, world) in cp_recipes(Path(llm_src), dummies).items():
        parser_says = io.StringIO()
        try:
            with contextlib.redirect_stderr(parser_says):
                args = megatron_args(_walked_argv(argv, dummies), world)
            assert args.mla_latent_all_gather and args.context_parallel_size > 1, args
            results[recipe] = OK
        except SystemExit:  # argparse's own refusal, printed
            results[recipe] = HOST + parser_says.getvalue().strip().splitlines()[-1]
        except Exception as exc:  # reported per recipe; the test names it and where
            where = traceback.extract_tb(exc.__traceback__)[-1]
            results[recipe] = f"{type(exc).__name__}: {exc} ({where.filename}:{where.lineno})"
    return results


# --- pytest ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def walked(host_sources):
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True,
                          env=dict(os.environ, **host_sources), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_cp_recipe_has_a_row(walked):
    assert sorted(walked) == sorted(EXPECTED)


@pytest.mark.parametrize("recipe", list(EXPECTED))
def test_recipe_validates_or_is_refused_by_name(walked, recipe):
    result, expected = walked[recipe], EXPECTED[recipe]
    if expected == OK:
        assert result == OK, result
    elif expected.startswith(HOST):
        assert result == expected, result
    else:  # LAGA's own refusal, naming the flag and the fix
        assert result.startswith("ValueError: ") and expected in result, result
        assert any(f in result for f in ("laga_checks.py", "dsa_checks.py", "laga_feature.py")), result


if __name__ == "__main__":
    print(json.dumps(validate_all(os.environ["MINDSPEED_LLM_SRC"])))

"""MindSpeed-LLM's own DeepSeek-V3 pretrain recipes plus ``--mla-latent-all-gather`` validate.

The flags come from the real stock scripts of the ``host_sources`` fixture
(``examples/mcore/deepseek3/pretrain_deepseek3_671b_4k_ptd.sh`` and
``..._A3_ptd.sh``): bash runs each script with ``python`` replaced by a function
that prints its arguments, so the script expands its own variables. Only these
change: the placeholder paths become dummies, ``CP=8`` with the algorithm
under test, the DualPipe group (``--schedules-method dualpipev --moe-fb-overlap``)
is dropped (MindSpeed rejects dualpipev with CP, and fb-overlap with
``--noop-layers`` then needs a virtual pipeline) and the LAGA flag is added. Megatron
core_v0.12.1's ``parse_args`` with MindSpeed-LLM's argument pipeline and
validation (LAGAFeature last in its features list) must then pass; so
``--reset-attention-mask``, MTP, ``--noop-layers``, ``--mla-mm-split``, ``--mla-fa-without-pad`` and the recompute settings of the
scripts are all accepted.

Run in one subprocess (the real hosts put stubs and their sources on sys.path):
``python tests/mindspeed/test_stock_recipe.py`` prints one line per recipe and algorithm.
"""
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
from support.recipes import RECIPE_DIR, RECIPES, recipe_argv  # noqa: E402

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

CP_SIZE = 8
HYBRID = ["--ulysses-degree-in-cp", "2"]
PACKED = "--reset-attention-mask"
UNPACKED = [PACKED, "--reset-position-ids"]  # (2.2.0's recipe packs with the latter)
# case -> (--context-parallel-algo, flags added, flags dropped, "ok" or LAGA's error text)
CASES = {
    "ulysses_cp_algo": ("ulysses_cp_algo", [], [], "ok"),
    "kvallgather_cp_algo": ("kvallgather_cp_algo", [], [], "ok"),
    "megatron_cp_algo": ("megatron_cp_algo", [], [], "ok"),
    # hybrid splits packed documents per ring, which LAGA does not cover: a named error
    "hybrid_cp_algo": ("hybrid_cp_algo", HYBRID, [],
                       "hybrid_cp_algo and --reset-attention-mask is not supported"),
    "hybrid_cp_algo unpacked": ("hybrid_cp_algo", HYBRID, UNPACKED, "ok"),
}
# the scripts' DUALPIPE_ARGS: MindSpeed rejects dualpipev with CP ("The dualpipev and
# context_parallel are incompatible"), and --moe-fb-overlap with --noop-layers without it
# then needs a virtual pipeline (MindSpeed's fb_overlap feature), so both go
DUALPIPE = (["--schedules-method", "dualpipev"], ["--moe-fb-overlap"])
LAGA = "--mla-latent-all-gather"
HOST = "host: "  # an expected error the host itself raises, before LAGA's checks


# MTP with CP: Megatron core_v0.12.1 rejects it (2.2.0 and 2.3.0 keep that check),
# 26.0.0 and 26.1.0 reject it with packed documents; those releases are also checked
# without it
NO_MTP = [("--mtp-num-layers", 1), ("--mtp-loss-scaling-factor", 1), "--mtp-mem-efficient-logits"]
MTP_WITH_PACKING = ("Multi-Token Prediction(MTP) is not supported with Context "
                    "Parallelism(CP) in pack")
MTP_REFUSED = {
    "26.1.0": MTP_WITH_PACKING,
    "26.0.0": MTP_WITH_PACKING,
    "2.3.0": "Multi-Token Prediction (MTP) is not supported with Context Parallelism",
    "2.2.0": "Multi-Token Prediction (MTP) is not supported with Context Parallelism",
}


def release_cases(release: str) -> dict:
    """CASES as each release takes the recipe. 2.2.0 and 2.3.0 have no kvallgather_cp_algo.
    Where the host refuses MTP with CP (MTP_REFUSED) that refusal is expected, and each
    case is checked again without MTP: then 2.3.0 takes packed documents only with
    megatron_cp_algo (its MindSpeed splits every document zigzag) and 2.2.0 with none
    (its recipe packs them with --reset-position-ids, the THD form LAGA refuses by name, so
    2.2.0 is also checked unpacked)."""
    cases = dict(CASES)
    if release in ("2.3.0", "2.2.0"):
        del cases["kvallgather_cp_algo"]
    if release in MTP_REFUSED:
        for case, (algo, extra, dropped, expected) in list(cases.items()):
            if MTP_REFUSED[release] != MTP_WITH_PACKING or PACKED not in dropped:
                cases[case] = (algo, extra, dropped, HOST + MTP_REFUSED[release])
            cases[f"{case} without MTP"] = (algo, extra, dropped + NO_MTP, expected)
    laga_refuses = ("--reset-attention-mask and {} is not supported on MindSpeed-LLM " +
                    release)
    if release == "2.3.0":
        cases["ulysses_cp_algo without MTP"] = (
            "ulysses_cp_algo", [], NO_MTP, laga_refuses.format("ulysses_cp_algo"))
    if release == "2.2.0":  # its recipe packs with --reset-position-ids: THD, not LAGA's
        for case, (algo, extra, dropped, _) in list(cases.items()):
            if case.endswith("without MTP") and PACKED not in dropped:
                cases[case] = (algo, extra, dropped, "--shape-order TND is not supported")
        for algo in ("ulysses_cp_algo", "megatron_cp_algo"):
            cases[f"{algo} unpacked without MTP"] = (algo, [], UNPACKED + NO_MTP, "ok")
    return cases


def with_laga(argv, extra, dropped=()):
    """``dropped``: flags, or (flag, number of values it takes)."""
    argv = list(argv)
    for flag in dropped:
        flag, values = flag if isinstance(flag, tuple) else (flag, 0)
        if flag in argv:
            i = argv.index(flag)
            del argv[i:i + 1 + values]
    for flags in DUALPIPE:
        i = argv.index(flags[0])
        assert argv[i:i + len(flags)] == flags, argv[i:i + len(flags)]
        del argv[i:i + len(flags)]
    return argv + extra + [LAGA]


def validate_all(llm_src: str) -> dict:
    """{"release": the release identified, "recipe algo": "ok" or the error}; runs the real
    argument pipeline."""
    from support.mindspeed_llm_real import host_release, megatron_args, prepare

    prepare()
    release = host_release().name
    dummies = Path(tempfile.mkdtemp(prefix="stock-recipe-"))
    # --enable-hf2mg-convert: MindSpeed-LLM looks for the HF weights in the load dir (and
    # 26.0.0 reads the model type from their config.json)
    (dummies / "CKPT_LOAD_DIR").mkdir()
    (dummies / "CKPT_LOAD_DIR" / "model.safetensors").touch()
    (dummies / "CKPT_LOAD_DIR" / "config.json").write_text(
        json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    (dummies / "TOKENIZER_PATH").mkdir()  # MindSpeed checks that it exists
    import torch
    import torch_npu.npu  # the stand-in of mindspeed_llm_real.prepare (its npu module, as
    # importing it later would replace the attribute set below)

    # --use-ascend-coc asks the NPU's name (the A2 recipe sets it): an Atlas A2
    torch_npu.npu.get_device_name = lambda *a, **k: "Ascend910B3"
    # --moe-grouped-gemm asks the device's compute capability (torch_npu answers on
    # Ascend); on CPU answer as a capable device does
    torch.cuda.get_device_capability = lambda *a, **k: (8, 0)
    results = {"release": release}
    for recipe in RECIPES:
        for case, (cp_algo, extra, dropped, _) in release_cases(release).items():
            argv, world = recipe_argv(Path(llm_src) / RECIPE_DIR / recipe, cp_algo, CP_SIZE, dummies)
            try:
                args = megatron_args(with_laga(argv, extra, dropped), world)
                checks = dict(laga=args.mla_latent_all_gather, cp=args.context_parallel_size,
                              algo=args.context_parallel_algo,
                              documents=args.reset_attention_mask)
                expected = dict(laga=True, cp=CP_SIZE, algo=cp_algo,
                                documents=PACKED not in dropped)
                assert checks == expected, checks
                results[f"{recipe} {case}"] = "ok"
            except Exception as exc:  # reported per case, the test names it and where
                where = traceback.extract_tb(exc.__traceback__)[-1]
                results[f"{recipe} {case}"] = (f"{type(exc).__name__}: {exc} "
                                               f"({where.filename}:{where.lineno})")
    return results


# --- pytest ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stock_results(release_host_sources):
    """(release, {"recipe case": result}) of one release pair's stock scripts."""
    release, sources = release_host_sources
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True,
                          env=dict(os.environ, **sources), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    # the sources identify the facts' owner (a release the same as another: that one), and
    # the pair takes the owner's cases
    from mindspeed_laga.patches.mindspeed_llm.releases import BY_NAME
    owner = BY_NAME[release].facts_owner
    assert results.pop("release") == owner
    return owner, results


def check_result(result: str, expected: str) -> None:
    if expected == "ok":
        assert result == "ok", result
    elif expected.startswith(HOST):  # the host's own refusal comes first
        assert expected[len(HOST):] in result and "mindspeed" in result, result
    else:  # rejected by LAGA, naming the flags and the fix
        assert result.startswith("ValueError: ") and expected in result, result
        assert ("laga_checks.py" in result or "laga_feature.py" in result) and LAGA in result, \
            result


@pytest.mark.parametrize("recipe", RECIPES)
def test_stock_recipe_with_laga_validates(stock_results, recipe):
    """Every case of this release: ok, or refused by name (see release_cases)."""
    release, results = stock_results
    cases = release_cases(release)
    assert sorted(k for k in results if k.startswith(recipe + " ")) == \
        sorted(f"{recipe} {case}" for case in cases)
    for case, (_, _, _, expected) in cases.items():
        check_result(results[f"{recipe} {case}"], expected)


def test_the_recipe_is_read_from_the_stock_script(host_sources):
    """What the parse yields is the script's own flag set: packed documents, MTP, the
    DualPipe schedule, at its world size."""
    script = Path(host_sources["MINDSPEED_LLM_SRC"]) / RECIPE_DIR / RECIPES[0]
    argv, world = recipe_argv(script, "ulysses_cp_algo", CP_SIZE)
    assert world == 512
    for flag in ("--reset-attention-mask", "--mtp-num-layers", "--moe-fb-overlap",
                 "--multi-latent-attention", "--noop-layers"):
        assert flag in argv, flag
    assert argv[argv.index("--context-parallel-size") + 1] == str(CP_SIZE)
    assert argv[argv.index("--save") + 1] == "/dummy/CKPT_SAVE_DIR"
    assert LAGA not in argv and "dualpipev" in argv and "dualpipev" not in with_laga(argv, [])


if __name__ == "__main__":
    print(json.dumps(validate_all(os.environ["MINDSPEED_LLM_SRC"])))

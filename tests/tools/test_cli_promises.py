"""The CLI's promises across subcommands: one dtype vocabulary (both spellings everywhere),
every argument error one line with a non-zero exit, output paths proven writable first, the
shape flags setting the sizes they name."""
import pytest

from mindspeed_laga.tools import cli
from mindspeed_laga.tools.cases import MLAShape
from mindspeed_laga.tools.commands.shapes import shape_from_args

SPELLINGS = [("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp32", "float32"),
             ("float32", "float32"), ("BF16", "bfloat16")]


@pytest.mark.parametrize("command", ["plan", "verify", "bench"])
@pytest.mark.parametrize("given, meant", SPELLINGS)
def test_every_subcommand_takes_both_dtype_spellings(command, given, meant):
    assert cli.build_parser().parse_args([command, "--dtype", given]).dtype == meant


@pytest.mark.parametrize("given", ["fp16", "float16"])
def test_plan_models_float16_in_both_spellings(given):
    assert cli.build_parser().parse_args(["plan", "--dtype", given]).dtype == "float16"


def _main(capsys, *argv):
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr()


@pytest.mark.parametrize("argv, words", [
    (["verify", "--dtype", "fp16"], ["mindspeed-laga verify: error:", "fp32/float32, bf16/bfloat16"]),
    (["verify", "--cp", "0"], ["mindspeed-laga verify: error:", "must be positive"]),
    (["plan", "--dtype", "int4"], ["mindspeed-laga plan: error:", "'int4' is not a dtype"]),
    (["doctor", "--json", "/dev/full"], ["mindspeed-laga doctor: error:", "cannot be written"]),
    (["doctor", "--markdown", "/proc/x.md"], ["mindspeed-laga doctor: error:", "cannot be written"]),
])
def test_errors_are_one_line(capsys, argv, words):
    code, captured = _main(capsys, *argv)
    assert code == 2, captured
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), captured.err


@pytest.mark.parametrize("command, seq_len_flag", [("verify", "--seq-len"), ("bench", "--seq-lens")])
def test_shape_flags_set_the_sizes_they_name(command, seq_len_flag):
    """A distinct value per flag, none a default, so a flag wired to another size (or to
    none) shows."""
    args = cli.build_parser().parse_args([
        command, seq_len_flag, "17", "--micro-batch", "3", "--heads", "5", "--qk-head-dim", "7",
        "--qk-pos-emb-head-dim", "11", "--v-head-dim", "13", "--kv-lora-rank", "19"])
    shape = shape_from_args(args, 17 if command == "bench" else None)
    assert shape == MLAShape(seq_len=17, batch=3, heads=5, qk_head_dim=7, rope_dim=11,
                             v_head_dim=13, kv_lora_rank=19)


def _plan(capsys, *argv):
    from support.cli_runs import run_cli
    code, out, err = run_cli(capsys, "plan", *argv)
    assert code == 0, err
    return out


def test_plan_answers_first_and_num_layers_gives_the_per_iteration_figure(capsys):
    """The recommendation (flags, recipe variables, per-iteration figures) comes before the
    tables; --num-layers alone (no --device-memory) multiplies the per-layer answer."""
    import json
    out = _plan(capsys, "--num-layers", "61")
    assert out.index("recommendation (") < out.index("the tables behind it:") < out.index("\ncp_algo=")
    answer = " ".join(out[:out.index("the tables behind it:")].split())
    rec = json.loads(_plan(capsys, "--num-layers", "61", "--json"))["recommendation"]
    best = rec["best"]
    assert rec["layers"] == 61
    assert f"per iteration (61 layers, fwd+bwd, one micro-batch): {61e3 * best['total_s']:.2f} ms" in answer
    assert f"flags: {best['flags']}" in answer
    assert best["recipe_env"] in answer


def test_the_recipe_variables_are_the_ones_the_recipes_read(capsys):
    """Every variable plan prints is one scripts/deepseek3_common.sh (or the pretrain recipe)
    reads, and CP_TYPE is the --context-parallel-algo of the flags."""
    import json
    import re
    from pathlib import Path
    scripts = Path(__file__).resolve().parents[2] / "scripts"
    read = set(re.findall(r"^(\w+)=\$\{\1:-", (scripts / "deepseek3_common.sh").read_text()
                          + (scripts / "pretrain_deepseek3_laga.sh").read_text(), flags=re.M))
    for argv in ([], ["--cp", "16", "--cp-algo", "hybrid", "--ulysses-degree", "4"],
                 ["--device-memory", "1", "--num-layers", "61"]):
        best = json.loads(_plan(capsys, "--json", *argv))["recommendation"]["best"]
        env = dict(kv.split("=") for kv in best["recipe_env"].split())
        assert set(env) <= read, set(env) - read
        assert f"--context-parallel-algo {env['CP_TYPE']}" in best["flags"]
        assert env["LAGA"] == ("1" if "--mla-latent-all-gather" in best["flags"] else "0")
        for var, flag in (("LAGA_OVERLAP", "--mla-laga-overlap"), ("LAGA_TRIM", "--mla-laga-trim-causal-prefix"),
                          ("LAGA_RECOMPUTE", "--mla-laga-recompute-kv")):
            assert (env.get(var) == "1") == (flag in best["flags"]), (var, best)


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2"])
def test_plan_names_the_preset_its_dims_come_from(capsys, name):
    from mindspeed_laga.tools.costmodel.presets import PRESETS
    assert name in PRESETS
    out = _plan(capsys, "--preset", name)
    assert f"\ndims: preset {name}\n" in out
    assert f"\ndims: preset {name} and the dim flags\n" in _plan(capsys, "--preset", name, "--heads", "8")

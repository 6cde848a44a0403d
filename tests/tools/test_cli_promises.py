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

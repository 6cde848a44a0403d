"""``mindspeed-laga plan``: the model's table, JSON, fit check, time estimate and errors."""
import json
import subprocess
import sys

import pytest

from mindspeed_laga import cli
from mindspeed_laga import costmodel as cm


def run_cli(capsys, *argv):
    try:
        code = cli.main(["plan", *argv])
    except SystemExit as exc:  # argparse errors exit from inside parse_args
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_default_is_deepseek_v3_ulysses_cp8_both_kernels(capsys):
    code, out, err = run_cli(capsys)
    assert code == 0, err
    assert "n=128 d_n=128 d_r=64 d_v=128 d_c=512, S=16384, b=1, CP=8, TP=1, bfloat16" in out
    assert "cp_algo=ulysses" in out and "saved eager" in out and "saved fused" in out
    for name in ("explicit", "absorbed", "laga"):
        assert f"\n{name} " in out
    assert out.count("fastest:") == 2  # 910B intra-node and cross-node


def test_json_carries_the_model(capsys):
    code, out, _ = run_cli(capsys, "--json", "--cp-algo", "both")
    assert code == 0
    plan = json.loads(out)
    cfg = cm.Config(cm.preset("deepseek-v3"), 16384, 1, 8, 1, "allgather", None, "bfloat16", "fused")
    row = plan["algos"]["allgather"]["kernels"]["fused"]["laga"]
    want = cm.rank_summary(cfg, cm.Variant("laga", "laga"))
    assert row["saved_bytes"] == want["saved_bytes"]
    assert row["comm"]["forward"]["design"] == want["comm"]["forward"]["design"]
    assert plan["algos"]["ulysses"]["notes"]["comm_explicit_over_laga_design"] >= 1.9
    assert plan["algos"]["allgather"]["notes"]["comm_explicit_over_laga_design"] >= 60
    assert set(plan["time"]) == set(cm.MACHINES)


def test_fit_check_and_custom_machine(capsys):
    code, out, _ = run_cli(capsys, "--json", "--device-memory", "1", "--num-layers", "2",
                           "--link-bandwidth", "50", "--device-tflops", "100")
    plan = json.loads(out)
    fit = plan["algos"]["ulysses"]["fit"]
    for kernel, rows in fit.items():
        for name, r in rows.items():
            saved = plan["algos"]["ulysses"]["kernels"][kernel][name]["saved_bytes"]["worst"]
            assert r["bytes"] == 2 * saved
            assert r["fits"] == (2 * saved <= 2 ** 30)
    assert not fit["eager"]["explicit"]["fits"] and fit["fused"]["laga+blockwise"]["fits"]
    assert list(plan["time"]) == ["custom"]
    m = plan["time"]["custom"]
    assert (m["link_gbps"], m["tflops"]) == (50, 100)
    best = m["fastest"]
    assert best["seconds"] == min(t["total_s"] for r in m["rows"].values() for t in r.values())


def test_explicit_dims_and_v2_lite(capsys):
    code, out, _ = run_cli(capsys, "--preset", "deepseek-v2-lite", "--seq-len", "4096", "--cp", "4",
                           "--json")
    assert code == 0 and json.loads(out)["config"]["heads"] == 16
    code, out, _ = run_cli(capsys, "--heads", "32", "--kv-lora-rank", "256", "--json")
    cfg = json.loads(out)["config"]
    assert (cfg["heads"], cfg["kv_lora_rank"], cfg["qk_head_dim"]) == (32, 256, 128)


@pytest.mark.parametrize("argv, word", [
    (["--preset", "deepseek-v9"], "unknown preset"),
    (["--seq-len", "1000", "--cp", "3"], "not divisible"),
    (["--cp-algo", "allgather", "--seq-len", "16388", "--cp", "4"], "2*CP"),
    (["--cp", "256"], "heads"),
    (["--tp", "3"], "TP"),
    (["--seq-len", "-16"], "positive"),
    (["--micro-batch", "0"], "positive"),
    (["--heads", "-8"], "positive"),
    (["--dtype", "int4"], "dtype"),
    (["--device-memory", "64"], "--num-layers"),
    (["--cp", "x"], "invalid int"),
    (["--kernel", "cuda"], "invalid choice"),
])
def test_bad_input_is_one_line_error(capsys, argv, word):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and word in lines[0] and lines[0].startswith("mindspeed-laga plan: error:")
    assert "Traceback" not in err


def test_entry_point_error_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "mindspeed_laga", "plan", "--preset", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1

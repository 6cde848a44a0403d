"""``mindspeed-laga bench --dsa``: LAGA's sparse MLA on spawned ranks, the byte counter
beside the cost model."""
from __future__ import annotations

import json

import pytest

from mindspeed_laga.sparse.registry import SPARSE_KERNELS
from support.cli_runs import assert_one_line_error, run_cli


@pytest.mark.timeout(300)
def test_the_counter_sees_one_gather_of_704_values_or_576_reusing_picks_equal_to_the_model(capsys):
    """GLM-5.2 (DeepSeek-V3.2's gathered dims, its layers sharing picks): a computing layer
    gathers [kv_latent | k_pos_emb | index_key], 704 values a token, one reusing its picks
    [kv_latent | k_pos_emb], 576, each equal to the model; the layer mix follows."""
    code, out, err = run_cli(capsys, "bench", "--dsa", "glm-5.2", "--cp", "2", "--seq-lens", "64",
                             "--repeat", "1", "--warmup", "0", "--heads", "2", "--index-topk", "8",
                             "--json", "-")
    assert code == 0, err
    doc = json.loads(out)
    computing, reusing = doc["rows"]
    assert (computing["layer"], reusing["layer"]) == ("computing", "reusing")
    tokens, fp32 = 64 // 2, 4
    for row, width in ((computing, 512 + 64 + 128), (reusing, 512 + 64)):
        for direction in ("forward", "backward"):
            got = row[direction]
            assert (got["collectives"], got["values_per_token"]) == (1, width), got
            # a ring all-gather (reduce-scatter) at P = 2: the one other rank's shard
            assert got["wire_bytes"] == (2 - 1) * tokens * width * fp32 == got["model_wire_bytes"]
            assert got["counter_equals_model"]
    assert width == 576 and computing["forward"]["values_per_token"] == 704
    host = computing["host_model"]["host kvallgather"]["forward"]
    assert (host["collectives"], host["values_per_token"]) == (7, 1920)
    assert (doc["layer_mix"]["computing"], doc["layer_mix"]["reusing"]) == (21, 57)
    assert "yes" in err and "host ulysses" in err  # the table goes to stderr with --json -
    assert "57 reuse them" in " ".join(err.split())


@pytest.mark.parametrize("argv, word", [
    (("--num-docs", "2"), "--num-docs"),
    (("--layout", "doc_zigzag"), "--layout"),
    (("--seq-lens", "6"), "--seq-lens"),
    (("--index-topk", "0"), "--index-topk"),
])
def test_bad_input_is_one_line_error(capsys, argv, word):
    code, _, err = run_cli(capsys, "bench", "--dsa", "deepseek-v3.2", "--cp", "2", "--json", "", *argv)
    assert_one_line_error("bench", code, err, word)


@pytest.mark.timeout(300)
def test_reruns_write_into_the_default_folder(capsys, tmp_path, monkeypatch):
    """bench --dsa writes its own file, bench_dsa.json: a dense bench's bench.json stays."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench_out").mkdir()  # what a plain bench leaves behind
    (tmp_path / "bench_out" / "bench.json").write_text("{}")
    for _ in range(2):
        code, out, err = run_cli(capsys, "bench", "--dsa", "deepseek-v3.2", "--cp", "2", "--seq-lens", "32",
                                 "--repeat", "1", "--warmup", "0", "--heads", "2", "--index-topk", "4")
        assert code == 0, err
        assert "JSON: bench_out/bench_dsa.json" in out
    assert json.loads((tmp_path / "bench_out" / "bench_dsa.json").read_text())["dsa"] == "deepseek-v3.2"
    assert (tmp_path / "bench_out" / "bench.json").read_text() == "{}"


# the dense dims at their defaults too: typed is refused, whatever the value
DENSE_ONLY = [("--kernel", "eager"), ("--cp-algo", "allgather"), ("--forms-only",),
              ("--kv-lora-rank", "32"), ("--qk-pos-emb-head-dim", "4"), ("--ulysses-degree", "2"),
              ("--kv-lora-rank", "64"), ("--qk-pos-emb-head-dim", "8"), ("--kernel", "sdpa"),
              ("--kv-block-size", "16"), ("--doc-lens", "32,32")]


@pytest.mark.parametrize("argv", DENSE_ONLY, ids=[" ".join(a) for a in DENSE_ONLY])
def test_dense_only_flags_are_refused_by_name(capsys, argv):
    code, _, err = run_cli(capsys, "bench", "--dsa", "deepseek-v3.2", "--cp", "2", "--json", "",
                           "--seq-lens", "64", *argv)
    assert_one_line_error("bench", code, err, f"drop {argv[0]}")


def test_a_length_past_the_machines_memory_is_refused_before_any_rank(capsys):
    # GLM-5 at S = 65536 on 2 ranks: each rank's float32 indexer scores alone are
    # [1, 32 index heads, 32768 queries, 65536 keys] x 4 B = 256 GiB
    code, _, err = run_cli(capsys, "bench", "--dsa", "glm-5", "--cp", "2", "--json", "",
                           "--seq-lens", "65536")
    assert_one_line_error("bench", code, err, "--seq-lens: S=65536 needs about")


def test_the_fit_check_counts_the_indexer_scores_of_every_rank():
    from mindspeed_laga.tools.commands import bench_dsa
    scores = 1 * 32 * 32768 * 65536 * 4
    assert bench_dsa.rank_peak_bytes(65536, 2, 1, 32) >= 2 * scores  # two float32 copies
    need = 2 * bench_dsa.rank_peak_bytes(256, 2, 1, 32)
    bench_dsa.check_fits([256], 2, 1, 32, available=need)  # fits exactly
    with pytest.raises(ValueError, match="--seq-lens: S=256"):
        bench_dsa.check_fits([128, 256], 2, 1, 32, available=need - 1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kernel", SPARSE_KERNELS)
def test_every_registered_sparse_kernel_runs_or_is_refused_by_name(capsys, kernel):
    """--sparse-kernel takes each name of the registry: it runs every stage (the JSON says
    which) or, where it cannot run here, is refused in one line before any rank starts."""
    from mindspeed_laga.sparse.registry import sparse_kernel
    from mindspeed_laga.sparse.stage import STAGES, SparseDims
    try:
        for stage in STAGES:
            sparse_kernel(kernel).check(stage, "kernel", SparseDims(512, 64, 128, 2, 2, 64, 4))
        runs = True
    except ValueError:
        runs = False
    code, out, err = run_cli(capsys, "bench", "--dsa", "deepseek-v3.2", "--cp", "2", "--seq-lens", "32",
                             "--repeat", "1", "--warmup", "0", "--heads", "2", "--index-topk", "4",
                             "--sparse-kernel", kernel, "--json", "-")
    if runs:
        assert code == 0, err
        assert json.loads(out)["sparse_kernel"] == kernel
    else:
        assert_one_line_error("bench", code, err, f"--sparse-kernel='{kernel}'")


def test_an_unregistered_sparse_kernel_is_refused_naming_the_registered_ones(capsys):
    code, _, err = run_cli(capsys, "bench", "--dsa", "glm-5", "--cp", "2", "--seq-lens", "32",
                           "--sparse-kernel", "nope", "--json", "")
    assert_one_line_error("bench", code, err, f"use one of {SPARSE_KERNELS}")

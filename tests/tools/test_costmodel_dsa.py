"""Sparse MLA (DSA) in the cost model and ``plan --dsa``: every figure equals one derived
here by hand from the dims, at DeepSeek-V3.2's and GLM-5's (32 index heads)."""
from __future__ import annotations

import json

import pytest

from mindspeed_laga.tools.costmodel import dsa
from support.cli_runs import assert_one_line_error, run_cli

MiB = 2 ** 20
BF16 = 2


def values(name, direction, model):
    return dsa.dsa_table(*dsa.dsa_preset(model), 16384, 2, 1, BF16)["paths"][name][direction]


def test_deepseek_v32_values_per_token():
    d_c, d_r, index_dim, index_heads, n, d_n, d_v, hidden = 512, 64, 128, 64, 128, 128, 128, 7168
    # kvallgather: index key; latent as K, latent as V, k_rope; latent, index key, k_rope for the loss
    host = values("host kvallgather", "forward", "deepseek-v3.2")
    assert (host["collectives"], host["values_per_token"]) == (7, index_dim + 3 * d_c + 2 * d_r + index_dim)
    assert host["values_per_token"] == 1920
    # backward: K, V, k_rope of the attention and the loss's index key
    host_bwd = values("host kvallgather", "backward", "deepseek-v3.2")
    assert (host_bwd["collectives"], host_bwd["values_per_token"]) == (4, 2 * d_c + d_r + index_dim) == (4, 1216)
    laga = values("laga", "forward", "deepseek-v3.2")
    assert (laga["collectives"], laga["values_per_token"]) == (1, d_c + d_r + index_dim) == (1, 704)
    assert values("laga", "backward", "deepseek-v3.2")["values_per_token"] == 704
    # ulysses: index q, index k, hidden; Q, K, V, O all-to-all; per-head q and k for the loss
    ulysses = values("host ulysses", "forward", "deepseek-v3.2")
    indexer = index_heads * index_dim + index_dim + hidden
    heads = 2 * n * (d_n + d_r) + 2 * n * d_v
    loss = 2 * n * (d_n + d_r)
    assert (indexer, heads, loss) == (15_488, 81_920, 49_152)
    assert ulysses["values_per_token"] == indexer + heads + loss == 146_560
    assert values("host ulysses", "backward", "deepseek-v3.2")["values_per_token"] == indexer + heads


def test_glm5_values_per_token():
    """GLM-5: 64 heads, d_n 192, d_v 256, hidden 6144, 32 index heads."""
    n, d_n, d_r, d_v, d_c, hidden, index_heads, index_dim = 64, 192, 64, 256, 512, 6144, 32, 128
    assert values("host kvallgather", "forward", "glm-5")["values_per_token"] == 3 * d_c + 2 * d_r + 2 * index_dim
    assert values("laga", "forward", "glm-5")["values_per_token"] == d_c + d_r + index_dim
    ulysses = values("host ulysses", "forward", "glm-5")["values_per_token"]
    assert ulysses == (index_heads * index_dim + index_dim + hidden) + (4 * n * (d_n + d_r) + 2 * n * d_v)
    assert ulysses == 108_672


def test_128k_on_cp16_received_per_rank_and_layer():
    """S = 128K over 16 ranks: 8192 tokens a rank, 15 other ranks' shards received per gather."""
    table = dsa.dsa_table(*dsa.dsa_preset("deepseek-v3.2"), 131072, 16, 1, BF16)["paths"]
    assert table["host kvallgather"]["forward"]["received_bytes"] == 15 * 8192 * 1920 * BF16 == 450 * MiB
    assert table["laga"]["forward"]["received_bytes"] == 15 * 8192 * 704 * BF16 == 165 * MiB
    assert table["laga"]["backward"]["received_bytes"] == 165 * MiB
    # ulysses: gathers (P-1) shards, all-to-alls (P-1)/P of the local payload
    gathered, exchanged = 15_488 + 49_152, 81_920
    assert table["host ulysses"]["forward"]["received_bytes"] == (
        15 * 8192 * gathered * BF16 + 8192 * exchanged * BF16 * 15 // 16)


def test_plan_dsa_prints_the_128k_figures(capsys):
    code, out, err = run_cli(capsys, "plan", "--dsa", "deepseek-v3.2", "--seq-len", "131072", "--cp", "16")
    assert code == 0, err
    assert "S=131072, b=1, CP=16, TP=1, bfloat16" in out
    lines = {line.split("  ")[0]: line for line in out.splitlines()}
    assert "1,920" in lines["host kvallgather"] and "450.00 MiB" in lines["host kvallgather"]
    assert "146,560" in lines["host ulysses"]
    assert "704" in lines["laga"] and "165.00 MiB" in lines["laga"]
    assert "host kvallgather / laga: 2.73x the bytes, 7 collectives instead of 1" in out
    assert max(len(line) for line in out.splitlines()) <= 100


def test_plan_dsa_json_and_index_heads_override(capsys):
    code, out, _ = run_cli(capsys, "plan", "--dsa", "glm-5", "--index-heads", "64", "--json")
    assert code == 0
    table = json.loads(out)["dsa"]
    assert (table["index_heads"], table["cp_size"]) == (64, 8)
    assert table["paths"]["host ulysses"]["forward"]["values_per_token"] == 108_672 + 32 * 128


@pytest.mark.parametrize("argv, word", [
    (("--tp", "2"), "--tp"),
    (("--num-docs", "4"), "--num-docs"),
    (("--index-heads", "0"), "--index-heads"),
    (("--seq-len", "1000", "--cp", "16"), "--seq-len"),
])
def test_plan_dsa_refuses_what_it_does_not_model(capsys, argv, word):
    code, _, err = run_cli(capsys, "plan", "--dsa", "deepseek-v3.2", *argv)
    assert_one_line_error("plan", code, err, word)


def test_an_unknown_dsa_model_is_one_error_line(capsys):
    code, _, err = run_cli(capsys, "plan", "--dsa", "deepseek-v3")
    assert_one_line_error("plan", code, err, "--dsa")


def test_glm52_layer_mix(capsys):
    """GLM-5.2's 78 layers at --index-topk-freq 4 --index-skip-topk-offset 3: layer L takes
    the picks of L - (max(L - 3, 0) % 4), so 1, 2, 3 and 7, 11, ..., 75 compute them (21),
    the other 57 reuse them and gather no index key."""
    code, out, _ = run_cli(capsys, "plan", "--dsa", "glm-5.2", "--json")
    assert code == 0
    mix = json.loads(out)["dsa"]["layer_mix"]
    computing = [1, 2, 3] + list(range(7, 79, 4))
    assert (mix["computing"], mix["reusing"]) == (len(computing), 78 - len(computing)) == (21, 57)
    assert mix["values_per_token"] == {"computing": 512 + 64 + 128, "reusing": 512 + 64}
    assert mix["mean_values_per_token"] == (21 * 704 + 57 * 576) / 78
    code, out, _ = run_cli(capsys, "plan", "--dsa", "glm-5.2")
    assert "21 compute their picks and gather 704 values/token, 57 reuse them and gather 576" \
        in " ".join(out.split())
    code, out, _ = run_cli(capsys, "plan", "--dsa", "glm-5", "--json")
    assert "layer_mix" not in json.loads(out)["dsa"]  # GLM-5 runs every layer's indexer

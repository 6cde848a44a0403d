"""``mindspeed-laga bench --dsa``: LAGA's sparse MLA on spawned ranks, the byte counter
beside the cost model."""
from __future__ import annotations

import json

import pytest

from support.cli_runs import assert_one_line_error, run_cli


@pytest.mark.timeout(300)
def test_the_counter_sees_one_gather_of_704_values_equal_to_the_model(capsys):
    code, out, err = run_cli(capsys, "bench", "--dsa", "deepseek-v3.2", "--cp", "2", "--seq-lens", "64",
                             "--repeat", "1", "--warmup", "0", "--heads", "2", "--index-topk", "8",
                             "--json", "-")
    assert code == 0, err
    (row,) = json.loads(out)["rows"]
    tokens, fp32 = 64 // 2, 4
    for direction in ("forward", "backward"):
        got = row[direction]
        assert got["collectives"] == 1
        assert got["values_per_token"] == 512 + 64 + 128 == 704
        # a ring all-gather (reduce-scatter) at P = 2: the one other rank's shard
        assert got["wire_bytes"] == (2 - 1) * tokens * 704 * fp32 == got["model_wire_bytes"]
        assert got["counter_equals_model"]
    host = row["host_model"]["host kvallgather"]["forward"]
    assert (host["collectives"], host["values_per_token"]) == (7, 1920)
    assert "yes" in err and "host ulysses" in err  # the table goes to stderr with --json -


@pytest.mark.parametrize("argv, word", [
    (("--num-docs", "2"), "--num-docs"),
    (("--layout", "doc_zigzag"), "--layout"),
    (("--seq-lens", "6"), "--seq-lens"),
    (("--index-topk", "0"), "--index-topk"),
])
def test_bad_input_is_one_line_error(capsys, argv, word):
    code, _, err = run_cli(capsys, "bench", "--dsa", "deepseek-v3.2", "--cp", "2", "--json", "", *argv)
    assert_one_line_error("bench", code, err, word)

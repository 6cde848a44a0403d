"""``plan --backend fsdp2``: MindSpeed-LLM's FSDP2 context parallelism against LAGA's. Every
figure printed and in ``--json`` equals a closed form derived here from the dims, at
GLM-5.2's and DeepSeek-V3's; at the shrunk GLM layers of tests/support/fsdp2_glm.py the host's
widths are those its harness counts (the counting itself runs in CI's Ascend leg:
tests/mindspeed/test_fsdp2_glm_dsa.py asserts the counter equals this plan)."""
from __future__ import annotations

import json

import pytest

from mindspeed_laga.tools.commands.output import fmt_bytes
from support.cli_runs import assert_one_line_error, run_cli

MiB, GiB = 2 ** 20, 2 ** 30
BF16 = 2


def plan_json(capsys, *argv):
    code, out, err = run_cli(capsys, "plan", "--backend", "fsdp2", "--json", *argv)
    assert code == 0, err
    return json.loads(out)["fsdp2"]


def forward(table, path):
    return table["paths"][path]


def test_glm52_host_gathers_8320_values_and_laga_704_or_576(capsys):
    hidden, q_lora, rope, heads, d_n, d_v, latent, index_dim = 6144, 2048, 64, 64, 192, 256, 512, 128
    S, P = 131072, 4
    t = plan_json(capsys, "--dsa", "glm-5.2", "--cp", str(P), "--seq-len", str(S))
    host = forward(t, "host dsa_forward")
    gathered = [x["width"] for x in host["transfers"] if x["kind"] == "all_gather"]
    moved = [x["width"] for x in host["transfers"] if x["kind"] == "all_to_all"]
    assert gathered == [hidden, q_lora, rope, rope] and sum(gathered) == 8320
    assert moved == [heads * (d_n + rope)] * 2 + [heads * d_v] * 2 == [16384] * 4
    assert host["values_per_token"] == 8320 + 4 * 16384
    tokens = S // P
    assert host["received_bytes"] == (P - 1) * tokens * 8320 * BF16 + tokens * 4 * 16384 * BF16 * (P - 1) // P
    laga, reusing = forward(t, "laga"), forward(t, "laga, reusing picks")
    assert (laga["collectives"], laga["values_per_token"]) == (1, latent + rope + index_dim) == (1, 704)
    assert (reusing["collectives"], reusing["values_per_token"]) == (1, latent + rope) == (1, 576)
    assert laga["received_bytes"] == (P - 1) * tokens * 704 * BF16
    assert (t["layer_mix"]["computing"], t["layer_mix"]["reusing"]) == (21, 57)


@pytest.mark.parametrize("S", [4096, 32768, 131072])
def test_glm52_host_mask_peak_and_indexer_scores(capsys, S):
    b, index_heads = 2, 32
    t = plan_json(capsys, "--dsa", "glm-5.2", "--cp", "4", "--seq-len", str(S), "--micro-batch", str(b))
    squares = t["host_squares"]
    assert squares["index_mask"] == b * BF16 * S * S
    assert squares["index_mask_bool"] == b * S * S
    assert squares["mask_peak"] == b * 3 * S * S
    assert squares["indexer_scores"] == b * 4 * S * index_heads * S
    assert t["laga_squares"] == 0
    per_sample = {4096: 32 * MiB, 32768: 2 * GiB, 131072: 32 * GiB}[S]
    assert squares["index_mask"] == b * per_sample
    code, out, _ = run_cli(capsys, "plan", "--backend", "fsdp2", "--dsa", "glm-5.2", "--cp", "4",
                           "--seq-len", str(S))
    assert code == 0
    mask_line = next(line for line in out.splitlines() if line.lstrip().startswith("index mask"))
    assert mask_line.endswith(" " + fmt_bytes(per_sample)), mask_line


@pytest.mark.parametrize("cp_type, host, laga", [
    ("ulysses", [("all_to_all", 128 * 192)] * 2 + [("all_to_all", 128 * 128)] * 2,
     [("all_to_all", 128 * 192), ("all_gather", 512 + 64), ("all_to_all", 128 * 128)]),
    ("ring", [("ring_send", 128 * 192), ("ring_send", 128 * 128)], [("all_gather", 512 + 64)])])
def test_deepseek_v3_host_per_head_against_laga_latent(capsys, cp_type, host, laga):
    S, P = 131072, 4
    t = plan_json(capsys, "--cp", str(P), "--cp-type", cp_type, "--seq-len", str(S))
    rows = list(t["paths"].values())
    assert [(x["kind"], x["width"]) for x in rows[0]["transfers"]] == host
    assert [(x["kind"], x["width"]) for x in rows[1]["transfers"]] == laga
    tokens = S // P

    def wire(kind, width):
        payload = tokens * width * BF16
        return payload * (P - 1) // P if kind == "all_to_all" else (P - 1) * payload
    for row, parts in zip(rows, (host, laga)):
        assert row["received_bytes"] == sum(wire(k, w) for k, w in parts)
    assert (rows[0]["values_per_token"], rows[1]["values_per_token"]) == {
        "ulysses": (81_920, 41_536), "ring": (40_960, 576)}[cp_type]
    assert t["laga_cp_algo"] == {"ulysses": "ulysses", "ring": "allgather"}[cp_type]


def test_text_shows_the_json_figures(capsys):
    t = plan_json(capsys, "--dsa", "glm-5.2", "--cp", "4", "--seq-len", "131072")
    code, out, _ = run_cli(capsys, "plan", "--backend", "fsdp2", "--dsa", "glm-5.2", "--cp", "4",
                           "--seq-len", "131072")
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= 100  # plan fits a 100-column terminal
    for name, row in t["paths"].items():
        line = next(x for x in out.splitlines() if x.startswith(name + " "))
        assert line.split()[-3].replace(",", "") == str(row["values_per_token"]), line


def test_the_shrunk_glm_layers_plan_the_widths_the_harness_counts(capsys):
    """The harness's dims: the host gathers hidden, q_lora, cos, sin and moves per-head
    Q, K (heads x (d_n + d_r)), V and O (heads x d_v); LAGA gathers 704 then 576."""
    from support import fsdp2_glm
    c = fsdp2_glm.CONFIG
    t = plan_json(capsys, *fsdp2_glm.plan_flags())
    host = forward(t, "host dsa_forward")["transfers"]
    qk = c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
    out = c["num_attention_heads"] * c["v_head_dim"]
    assert [x["width"] for x in host if x["kind"] == "all_gather"] == [
        c["hidden_size"], c["q_lora_rank"], c["qk_rope_head_dim"], c["qk_rope_head_dim"]]
    assert [x["width"] for x in host if x["kind"] == "all_to_all"] == [qk, qk, out, out]
    assert forward(t, "laga")["values_per_token"] == 704
    assert forward(t, "laga, reusing picks")["values_per_token"] == 576
    assert t["host_squares"]["mask_peak"] == 3 * fsdp2_glm.SEQ ** 2 * fsdp2_glm.BATCH


@pytest.mark.parametrize("argv, word", [
    (("plan", "--cp-type", "ring"), "--backend fsdp2"),
    (("plan", "--backend", "fsdp2", "--tp", "2"), "drop --tp"),
    (("plan", "--backend", "fsdp2", "--cp-algo", "allgather"), "drop --cp-algo"),
    (("plan", "--backend", "fsdp2", "--preset", "kimi-k2"), "--preset deepseek-v3"),
    (("plan", "--backend", "fsdp2", "--dsa", "deepseek-v3.2"), "--dsa glm-5/glm-5.2"),
    (("plan", "--backend", "fsdp2", "--dsa", "glm-5.2", "--preset", "deepseek-v3"), "drop --preset"),
    (("plan", "--backend", "fsdp2", "--index-heads", "8"), "add --dsa glm-5.2"),
    (("plan", "--backend", "fsdp2", "--cp-type", "ring", "--cp", "4", "--seq-len", "12"),
     "multiple of 8"),
    (("plan", "--backend", "fsdp2", "--cp", "0"), "--cp must be positive")])
def test_refusals_name_the_fix(capsys, argv, word):
    code, _, err = run_cli(capsys, *argv)
    assert_one_line_error("plan", code, err, word)

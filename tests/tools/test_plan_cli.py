"""``mindspeed-laga plan``: the model's table, JSON, fit check, time estimate and errors."""
import json
import re
import subprocess
import sys
import time

import pytest

from mindspeed_laga.tools import cli
from mindspeed_laga.tools.costmodel import MACHINES
from mindspeed_laga.vocab.names import CP_ALGOS
from support.cli_runs import assert_one_line_error, run_cli


def test_default_is_deepseek_v3_ulysses_cp8_both_kernels(capsys):
    code, out, err = run_cli(capsys, "plan")
    assert code == 0, err
    assert "n=128 d_n=128 d_r=64 d_v=128 d_c=512, S=16384, b=1, CP=8, TP=1, bfloat16" in out
    assert "cp_algo=ulysses" in out and "saved eager" in out and "saved sdpa" in out
    for name in ("explicit", "absorbed", "laga"):
        assert f"\n{name} " in out
    assert "fastest:" not in out  # one answer: the recommendation, last
    assert out.count("recommendation (") == 1
    assert out.strip().splitlines()[-1].startswith("  ")  # nothing after the recommendation's lines


def test_json_carries_the_deepseek_v3_figures(capsys):
    """DeepSeek-V3 (n=128, d_n=128, d_r=64, d_v=128, d_c=512), S=16384 on CP=8, bf16:
    a rank hands 2048 tokens x 2 bytes per value to the collectives, per direction."""
    code, out, _ = run_cli(capsys, "plan", "--json", "--cp-algo", "both")
    assert code == 0
    plan = json.loads(out)
    rows = plan["algos"]["allgather"]["kernels"]["sdpa"]
    # allgather: explicit gathers K and V of every head, 128 * (192 + 128) = 40,960
    # values a token; LAGA the latent, 512 + 64 = 576.
    assert rows["explicit"]["comm"]["forward"]["payload"] == 40_960 * 2048 * 2
    assert rows["laga"]["comm"]["forward"]["payload"] == 576 * 2048 * 2
    assert rows["laga"]["comm"]["forward"]["design"] == 576 * 2048 * 2 * 7 / 8
    assert rows["laga"]["comm"]["backward"]["wire"] == 7 * 576 * 2048 * 2  # ring: 7 shards
    notes = plan["algos"]["allgather"]["notes"]
    assert notes["comm_explicit_over_laga_design"] == pytest.approx(40_960 / 576)
    # ulysses: explicit q, K, V, O by all-to-all (128 * 640 = 81,920 values); LAGA q and
    # O (40,960) plus the gathered latent (576).
    assert plan["algos"]["ulysses"]["notes"]["comm_explicit_over_laga_design"] == \
        pytest.approx(81_920 / (40_960 + 576))
    assert set(plan["time"]) == set(MACHINES)


TINY = ["--heads", "4", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8",
        "--kv-lora-rank", "16", "--seq-len", "64", "--cp", "2", "--cp-algo", "allgather",
        "--kernel", "fused", "--dtype", "fp32", "--json"]


def test_tiny_config_bytes_from_shapes(capsys):
    """n=4, d_n=8, d_r=4, d_v=8, d_c=16, S=64 on CP=2 (s=32), float32 (4 bytes), fused
    kernel, zigzag: each rank's queries are two segments of 16."""
    code, out, _ = run_cli(capsys, "plan", *TINY)
    assert code == 0
    rows = json.loads(out)["algos"]["allgather"]["kernels"]["sdpa"]
    # Forward: explicit gathers K [32, 1, 4, 12] and V [32, 1, 4, 8]; LAGA the latent [32, 1, 20].
    assert rows["explicit"]["comm"]["forward"]["payload"] == 32 * 4 * (12 + 8) * 4 == 10_240
    assert rows["laga"]["comm"]["forward"]["payload"] == 32 * 20 * 4 == 2_560
    query = 32 * 4 * 12 * 4                  # q [32, 1, 4, 12]
    key, value = 64 * 4 * 12 * 4, 64 * 4 * 8 * 4   # gathered or rebuilt [64, 1, 4, 12|8]
    out_, lse = 4 * 32 * 8 * 4, 4 * 32 * 4   # output [1, 4, 32, 8], float32 lse [1, 4, 32]
    index = 64 * 8                           # int64 permutation of the zigzag gather
    explicit = 32 * 16 * 4 + index + query + key + value + out_ + lse   # + local kv_latent
    laga = 64 * 20 * 4 + index + query + key + value + out_ + lse       # + gathered latent
    assert rows["explicit"]["saved_bytes"]["worst"] == explicit == 33_792
    assert rows["laga"]["saved_bytes"]["worst"] == laga == 36_864


def test_any_sequence_length_answers_at_once(capsys):
    start = time.perf_counter()
    code, out, err = run_cli(capsys, "plan", "--seq-len", str(2 ** 31), "--kv-block-size", "1",
                             "--cp-algo", "both", "--json")
    assert code == 0, err
    assert time.perf_counter() - start < 5  # a loop over one-key blocks would take hours
    assert json.loads(out)["config"]["seq_len"] == 2 ** 31


def test_fit_check_and_custom_machine(capsys):
    code, out, _ = run_cli(capsys, "plan", "--json", "--device-memory", "1", "--num-layers", "2",
                           "--link-bandwidth", "50", "--device-tflops", "100", "--cp-algo", "ulysses")
    plan = json.loads(out)
    fit = plan["algos"]["ulysses"]["fit"]
    for kernel, rows in fit.items():
        for name, r in rows.items():
            saved = plan["algos"]["ulysses"]["kernels"][kernel][name]["saved_bytes"]["worst"]
            assert r["bytes"] == 2 * saved
            assert r["fits"] == (2 * saved <= 2 ** 30)
    assert not fit["eager"]["explicit"]["fits"] and fit["sdpa"]["laga+blockwise"]["fits"]
    assert list(plan["time"]) == ["custom"]
    m = plan["time"]["custom"]
    assert (m["link_gbps"], m["tflops"]) == (50, 100)
    best = m["fastest"]
    assert best["seconds"] == min(t["total_s"] for r in m["rows"].values() for t in r.values())


def test_explicit_dims_and_v2_lite(capsys):
    code, out, _ = run_cli(capsys, "plan", "--preset", "deepseek-v2-lite", "--seq-len", "4096",
                           "--cp", "4", "--json")
    assert code == 0 and json.loads(out)["config"]["heads"] == 16
    code, out, _ = run_cli(capsys, "plan", "--heads", "32", "--kv-lora-rank", "256", "--json")
    cfg = json.loads(out)["config"]
    assert (cfg["heads"], cfg["kv_lora_rank"], cfg["qk_head_dim"]) == (32, 256, 128)


@pytest.mark.parametrize("argv, word", [
    (["--preset", "deepseek-v9"], "unknown preset"),
    (["--seq-len", "1000", "--cp", "3"], "not divisible"),
    (["--cp-algo", "allgather", "--seq-len", "16388", "--cp", "4"], "2*CP"),
    (["--cp", "256", "--cp-algo", "ulysses"], "heads"),
    (["--tp", "3"], "TP"),
    (["--seq-len", "-16"], "positive"),
    (["--micro-batch", "0"], "positive"),
    (["--heads", "-8"], "positive"),
    (["--dtype", "int4"], "dtype"),
    (["--device-memory", "64"], "--num-layers"),
    (["--cp", "x"], "invalid int"),
    (["--kernel", "cuda"], "invalid choice"),
    (["--device-memory", "nan", "--num-layers", "2"], "finite"),
    (["--device-memory", "inf", "--num-layers", "2"], "finite"),
    (["--link-bandwidth", "nan"], "finite"),
    (["--device-tflops=-inf"], "finite"),
    (["--device-tflops", "fast"], "not a number"),
    (["--kv-block-size", "0"], "positive"),
])
def test_bad_input_is_one_line_error(capsys, argv, word):
    code, out, err = run_cli(capsys, "plan", *argv)
    assert_one_line_error("plan", code, err, word)


def test_entry_point_error_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "mindspeed_laga", "plan", "--preset", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_documents_cut_attention_work_not_bytes(capsys):
    """16 equal documents: the visible pairs fall to about 1/16 of the causal sequence's
    ((s(s+1)/2 per document against S(S+1)/2), and so do the blockwise path's executed
    rectangles with blocks small beside a document; no collective moves a byte more or less."""
    base = ["--json", "--cp-algo", "allgather", "--kernel", "fused", "--seq-len", "65536",
            "--kv-block-size", "256"]
    _, one, _ = run_cli(capsys, "plan", *base)
    code, docs, err = run_cli(capsys, "plan", *base, "--num-docs", "16")
    assert code == 0, err
    one, docs = (json.loads(x)["algos"]["allgather"]["kernels"]["sdpa"] for x in (one, docs))
    for name in ("laga+blockwise", "laga+blockwise+trim"):
        a, b = (r[name]["flops"]["attention_fwd"]["average"] for r in (one, docs))
        assert 1 / 16 <= b / a < 1.1 / 16, name
        a, b = (r[name]["flops"]["attention_visible_fwd"]["average"] for r in (one, docs))
        assert b / a == pytest.approx(16 * 4096 * 4097 / (65536 * 65537), rel=1e-12)
    for name in one:
        assert one[name]["comm"] == docs[name]["comm"], name
    code, out, _ = run_cli(capsys, "plan", "--doc-lens", ",".join(["4096"] * 4),
                           "--kernel", "fused")
    assert code == 0 and "documents: 4096,4096,4096,4096" in out


def test_peak_column_and_terms(capsys):
    code, out, err = run_cli(capsys, "plan", "--kernel", "fused", "--terms")
    assert code == 0, err
    assert "peak sdpa" in out and "peak terms, rank 0, sdpa kernel" in out
    code, out, _ = run_cli(capsys, "plan", "--json", "--kernel", "eager")
    rows = json.loads(out)["algos"]["ulysses"]["kernels"]["eager"]
    for name, r in rows.items():
        terms = {t["name"]: t["bytes"] for t in r["peak_terms_rank0"]}
        # saved less the inputs' own storages (query; kv_latent), which the peak does not count
        inputs = sum(t["bytes"] for t in r["saved_terms_rank0"] if t["name"] in ("query", "kv_latent"))
        assert terms["saved"] == r["saved_bytes"]["rank0"] - inputs, name
        assert sum(terms.values()) == r["peak_bytes"]["rank0"] > terms["saved"] + terms["output"], name
        assert r["peak_bytes"]["worst"] >= r["peak_bytes"]["rank0"]


@pytest.mark.parametrize("argv, word", [
    (["--doc-lens", "4096,1024"], "--doc-lens sum to 5120, not the sequence length 16384"),
    (["--doc-lens", "8192,x"], "comma-separated integers"),
    (["--num-docs", "3"], "--num-docs 3 does not divide"),
    (["--num-docs", "4", "--doc-lens", "16384"], "not allowed with"),
    (["--layout", "doc_zigzag", "--cp-algo", "allgather"], "--doc-lens or --num-docs"),
    (["--layout", "doc_zigzag", "--cp-algo", "allgather", "--doc-lens", "8200,8184"], "divisible by 16"),
])
def test_document_flags_are_checked(capsys, argv, word):
    code, out, err = run_cli(capsys, "plan", *argv)
    assert out == ""
    assert_one_line_error("plan", code, err, word)


@pytest.mark.parametrize("argv", [[], ["--cp-algo", "both", "--terms"],
                                  ["--cp-algo", "hybrid", "--ulysses-degree", "8"],
                                  ["--kernel", "npu", "--device-memory", "64", "--num-layers", "4"]])
def test_tables_fit_100_columns(capsys, argv):
    code, out, err = run_cli(capsys, "plan", *argv)
    assert code == 0, err
    wide = [line for line in out.splitlines() if len(line) > 100]
    assert not wide, wide


@pytest.mark.parametrize("copies", [0, 2])
def test_memory_table_has_one_column_per_kernel_for_any_number_of_kernels(capsys, monkeypatch, copies):
    """``--kernel both`` shows every CPU kernel in its own columns headed by its name, kernels
    of the same cost-model kind too (none folded into another's column), in blocks that stay
    within 100 columns."""
    from mindspeed_laga.kernels.registry import KERNEL_NAMES, model_kind
    from mindspeed_laga.tools.commands import plan_args, plan_build
    extra = tuple(f"{k}_{i}" for i in range(copies) for k in KERNEL_NAMES)
    monkeypatch.setattr(plan_args, "CPU_KERNELS", KERNEL_NAMES + extra)
    monkeypatch.setattr(plan_build, "model_kind", lambda k, device: model_kind(k.split("_")[0], device))
    code, out, err = run_cli(capsys, "plan", "--kernel", "both", "--cp-algo", "allgather")
    assert code == 0, err
    wide = [line for line in out.splitlines() if len(line) > 100]
    assert not wide, wide
    headers = [block.splitlines()[0].split() for block in out.split("\nmemory")[1:]]
    named = [cell for h in headers for cell in h if cell not in ("saved", "peak", "form/expl")]
    assert list(dict.fromkeys(named)) == list(KERNEL_NAMES + extra)  # each its own, in order


def test_every_flag_says_what_it_is():
    plan = cli.build_parser()._subparsers._group_actions[0].choices["plan"]
    silent = [a.option_strings for a in plan._actions if a.option_strings and not a.help]
    assert not silent, silent


def test_node_table_default_spans_two_nodes_and_hybrid_is_in_every_table(capsys):
    """With the node table and no --cp, CP covers two nodes (16 on 8-NPU nodes) so the
    inter-node link carries traffic, and the output says why; hybrid (U given) has rows in
    the one-link tables too."""
    code, out, err = run_cli(capsys, "plan", "--cp-algo", "hybrid", "--ulysses-degree", "8",
                             "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["config"]["cp_size"] == 16 and plan["cp_defaulted"]
    assert any(r["inter_bytes"] > 0 for r in plan["nodes"]["rows"] if r["cp_algo"] == "hybrid")
    for machine in plan["time"].values():  # the time tables show what --cp-algo asks
        assert set(machine["rows"]) == {"hybrid"}
        assert machine["ulysses_degree"] == 8
    assert {(r["cp_algo"], r["ulysses_degree"]) for r in plan["nodes"]["rows"]} == {("hybrid", 8)}
    code, out, _ = run_cli(capsys, "plan", "--cp-algo", "hybrid", "--ulysses-degree", "8")
    assert "CP=16: the default with the node table, two nodes of 8" in out
    assert len(re.findall(r"\n  variant +hybrid U=8\n", out)) == 2
    # U given, --cp-algo not: every algorithm compared, hybrid at that U among them
    code, out, _ = run_cli(capsys, "plan", "--ulysses-degree", "8")
    header = f"  {'variant':<20}" + "".join(f" {a:>12}" for a in CP_ALGOS) + f" {'hybrid U=8':>12}"
    assert out.count(header) == 2
    # an explicit one-node CP is kept, and the output says nothing crosses nodes
    code, out, _ = run_cli(capsys, "plan", "--cp", "8", "--npus-per-node", "8")
    assert "CP=8," in out and "every CP rank shares one node of 8: nothing crosses" in out
    code, out, _ = run_cli(capsys, "plan")  # no node table: CP 8 as before
    assert "CP=8," in out and "the default with the node table" not in out


def test_trim_rows_show_where_trimming_differs(capsys):
    """laga+trim: under allgather its rank-average rebuild is below LAGA's (the worst rank
    sees every key, so the worst-rank columns are LAGA's); under ulysses every rank sees
    every key and the row says so instead of repeating LAGA's figures."""
    code, out, _ = run_cli(capsys, "plan", "--cp-algo", "both", "--kernel", "fused")
    allgather, ulysses = out.split("the tables behind it:")[1].split("cp_algo=ulysses (layout")
    rows = {line.split()[0]: line.split() for line in allgather.split("memory")[0].splitlines()
            if line.startswith("laga")}
    assert rows["laga+trim"][1:-1] == rows["laga"][1:-1]  # worst-rank columns
    assert float(rows["laga+trim"][-1]) < 0.9 * float(rows["laga"][-1])  # rank average
    assert "laga+trim            = laga in every column (every rank sees every key)" in ulysses


def test_the_kernel_names_are_the_registrys_and_fused_is_an_alias_of_sdpa(capsys):
    """One kernel vocabulary across commands: plan's --kernel takes the registry's names (as
    bench, verify and the training flag do) and still accepts its old spelling."""
    code, sdpa, _ = run_cli(capsys, "plan", "--kernel", "sdpa", "--cp", "4", "--seq-len", "4096")
    code_alias, fused, _ = run_cli(capsys, "plan", "--kernel", "fused", "--cp", "4", "--seq-len", "4096")
    assert code == code_alias == 0 and sdpa == fused and "saved sdpa" in sdpa

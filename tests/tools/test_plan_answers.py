"""``plan`` answers every user alike: ``plan --dsa`` ends in one recommendation with its
flags, refuses every flag it does not model by its real name, and any plan costs the same
few ranks at any CP, with lengths bounded by the int64 pair count."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
from support.cli_runs import assert_one_line_error, run_cli

from mindspeed_laga.tools import costmodel as cm
from mindspeed_laga.tools.costmodel import cluster, dsa, summary
from mindspeed_laga.tools.runspec import RunSpec, standard_runs

V32 = ("plan", "--dsa", "deepseek-v3.2")
BF16 = 2


def test_plan_dsa_ends_in_one_recommendation_with_its_flags(capsys):
    code, out, err = run_cli(capsys, *V32, "--seq-len", "131072", "--cp", "16")
    assert code == 0, err
    lines = out.rstrip().splitlines()
    assert lines[-1] == "  flags: --context-parallel-algo kvallgather_cp_algo --mla-latent-all-gather"
    assert sum(line.startswith("recommendation") for line in lines) == 1
    assert "CP=16 spans 2 910B nodes of 8" in out
    # the times are the collectives' bytes over the 910B cross-node link (25 GB/s), derived
    # here from the model's widths: LAGA 704 values forward and backward, the host 1,920 + 1,216
    table = dsa.dsa_table(*dsa.dsa_preset("deepseek-v3.2"), 131072, 16, 1, BF16)["paths"]
    wire = 15 * (131072 // 16) * BF16
    laga_ms, host_ms = 1e3 * wire * 2 * 704 / 25e9, 1e3 * wire * (1920 + 1216) / 25e9
    assert table["laga"]["forward"]["values_per_token"] == 704
    text = " ".join(out.split())
    assert f"collectives {laga_ms:.2f} ms vs {host_ms:.2f} ms" in text


def test_plan_dsa_json_carries_the_recommendation_and_the_link_flag_moves_it(capsys):
    code, out, _ = run_cli(capsys, *V32, "--cp", "4", "--json")
    rec = json.loads(out)["dsa"]["recommendation"]
    code2, out2, _ = run_cli(capsys, *V32, "--cp", "4", "--json", "--link-bandwidth", "19.6")
    rec2 = json.loads(out2)["dsa"]["recommendation"]
    assert code == code2 == 0
    assert rec["best"]["path"] == rec2["best"]["path"] == "laga"
    assert rec2["best"]["comm_s"] == pytest.approx(10 * rec["best"]["comm_s"])  # 196 -> 19.6 GB/s


def test_plan_dsa_at_cp_1_keeps_the_hosts_attention(capsys):
    code, out, err = run_cli(capsys, *V32, "--cp", "1")
    assert code == 0, err
    assert "keep the host's attention (leave --mla-latent-all-gather off)" in " ".join(out.split())
    assert "flags:" not in out


def test_plan_dsa_with_heads_ulysses_cannot_split_says_so(capsys):
    code, out, err = run_cli(capsys, "plan", "--dsa", "glm-5", "--cp", "3", "--seq-len", "4101")
    assert code == 0, err
    assert "host ulysses: n/a" in out
    # 4101 cuts into 3 chunks, not 6: LAGA under the contiguous ulysses_cp_algo split
    assert out.rstrip().splitlines()[-1].endswith("ulysses_cp_algo --mla-latent-all-gather")


UNMODELLED = [("--kernel", "eager"), ("--preset", "kimi-k2"), ("--cp-algo", "allgather"),
              ("--layout", "zigzag"), ("--kv-block-size", "512"), ("--inter-node-bandwidth", "50"),
              ("--intra-node-bandwidth", "50"), ("--q-lora-rank", "1024"), ("--npus-per-node", "8"),
              ("--ulysses-degree", "2"), ("--device-tflops", "100"), ("--num-docs", "4"),
              ("--doc-lens", "8192,8192"), ("--device-memory", "64"), ("--num-layers", "4")]


@pytest.mark.parametrize("flag, value", UNMODELLED, ids=[f for f, _ in UNMODELLED])
def test_plan_dsa_refuses_every_flag_it_does_not_model_by_its_real_name(capsys, flag, value):
    code, _, err = run_cli(capsys, *V32, flag, value)
    assert_one_line_error("plan", code, err, f"drop {flag}")
    assert "--devices-per-node" not in err and "--seq-len" in err  # the modelled list, real names


@pytest.mark.parametrize("argv", [V32, ("plan",)], ids=["dsa", "dense"])
def test_a_length_past_the_int64_pair_count_is_refused(capsys, argv):
    code, _, err = run_cli(capsys, *argv, "--seq-len", str(10 ** 11), "--cp", "16")
    assert_one_line_error("plan", code, err, "--seq-len 100000000000")
    assert "3,037,000,499" in err


def test_the_plan_header_counts_the_nodes(capsys):
    code, out, _ = run_cli(capsys, "plan", "--cp", "16", "--seq-len", "65536")
    assert code == 0
    assert "CP=16 spans 2 910B nodes of 8" in out and "spans 910B node" not in out


def _counted(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(module, name, counting)
    return calls


@pytest.mark.parametrize("extra", [(), ("--npus-per-node", "8", "--ulysses-degree", "4")],
                         ids=["one link", "node table"])
def test_plan_costs_the_same_ranks_at_any_cp(capsys, monkeypatch, extra):
    ranks = _counted(monkeypatch, summary, "form_cost")
    placements = _counted(monkeypatch, cluster, "link_bytes")
    counts = []
    for cp in ("1024", "65536"):  # ulysses cannot split 128 heads at either
        summary.summarize.cache_clear()
        ranks.clear()
        placements.clear()
        code, _, err = run_cli(capsys, "plan", "--cp", cp, "--seq-len", "1048576", *extra)
        assert code == 0, err
        counts.append((len(ranks), len(placements)))
    assert counts[0] == counts[1]


CONFIGS = [dict(cp_algo="allgather"), dict(cp_algo="allgather", layout="contiguous"),
           dict(cp_algo="ulysses"), dict(cp_algo="hybrid", ulysses_degree=8),
           dict(cp_algo="allgather", doc_lens=(4096,) * 4 + (8192,) * 2)]


@pytest.mark.parametrize("change", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_the_sampled_ranks_find_the_worst_rank_of_every_rank(monkeypatch, change):
    cfg = replace(cm.Config(dims=cm.preset("deepseek-v3"), seq_len=32768, micro_batch=1, cp_size=64,
                            tp_size=1, cp_algo="allgather", layout=None, dtype="bfloat16",
                            kernel=cm.FUSED), **change)
    for spec in standard_runs(2048):
        sampled = summary.summarize.__wrapped__(cfg, spec)
        monkeypatch.setattr(summary, "EXACT_RANKS", 10 ** 9)
        every = summary.summarize.__wrapped__(cfg, spec)
        monkeypatch.undo()
        assert sampled.ranks_costed < every.ranks_costed == 64
        assert (sampled.saved_worst, sampled.peak_worst, sampled.flops_worst) == (
            every.saved_worst, every.peak_worst, every.flops_worst), spec.name
        assert sampled.saved_average == pytest.approx(every.saved_average, rel=0.05)


GRID = [(p, dpn, tp) for p in (3, 4, 6, 8, 12, 16, 24) for dpn in (4, 6, 8) for tp in (1, 2, 3)]


def test_the_placements_walked_give_every_ranks_answer(monkeypatch):
    """The node table walks placement_ranks (one rank, or one period of lcm(U, node)),
    not every rank: the worst placement is the same as over every rank, on whole and
    partial nodes, with TP dividing the node or not."""
    spec = RunSpec("laga+overlap", "laga", overlap=True)  # the overlap's hidden share counts too
    real = cluster.placement_ranks
    compared = 0
    for p, dpn, tp in GRID:
        for algo, u in [("allgather", 1), ("ulysses", 1)] + [("hybrid", u) for u in range(2, p) if p % u == 0]:
            cfg = cm.Config(dims=cm.preset("deepseek-v3"), seq_len=p * 192, micro_batch=1, cp_size=p,
                            tp_size=tp, cp_algo=algo, layout=None, dtype="bfloat16", kernel=cm.FUSED,
                            ulysses_degree=u)
            try:
                cm.validate(cfg)
            except ValueError:
                continue
            nodes = replace(cm.CLUSTERS["910b"], devices_per_node=dpn)
            s = cm.summarize(cfg, spec)
            walked = cm.estimate_cluster_seconds(cfg, s, nodes)
            monkeypatch.setattr(cluster, "placement_ranks", lambda c, d: range(c.cp_size))
            every = cm.estimate_cluster_seconds(cfg, s, nodes)
            monkeypatch.setattr(cluster, "placement_ranks", real)
            assert walked == every, (p, dpn, tp, algo, u)
            compared += 1
    assert compared > 100


def test_glm_5_2s_recommendation_is_made_on_its_layer_mix(capsys):
    """GLM-5.2: 21 of 78 layers compute their picks; the rest reuse them and, on every path,
    run no indexer and no loss (the host builds none there). The recommendation compares the
    mean layer of that mix, not a computing layer."""
    code, out, err = run_cli(capsys, "plan", "--dsa", "glm-5.2", "--seq-len", "131072", "--cp", "16",
                             "--json")
    assert code == 0, err
    t = json.loads(out)["dsa"]
    mix = t["layer_mix"]
    assert (mix["computing"], mix["reusing"], mix["layers"]) == (21, 57, 78)
    host = t["reusing_paths"]["host kvallgather"]["forward"]
    assert (host["collectives"], host["values_per_token"]) == (3, 512 + 512 + 64)  # K, V, k_rope
    assert t["reusing_paths"]["laga"]["forward"]["values_per_token"] == 512 + 64
    for name, rec in t["recommendation"]["paths"].items():
        computing, reusing = (sum(rows[name][d]["received_bytes"] for d in ("forward", "backward"))
                              for rows in (t["paths"], t["reusing_paths"]))
        assert rec["received_bytes"] == (21 * computing + 57 * reusing) / 78, name
    assert "21 of 78 layers" in t["recommendation"]["basis"]

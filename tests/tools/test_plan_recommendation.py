"""``plan`` ends with one recommendation: the CP algorithm (and U), the LAGA options and the
training flags, what they save against the host's explicit path, and why; consistent with
the tables above it and with --cp-algo."""
import json

import pytest

from mindspeed_laga.cp_algos import ALGOS
from support.cli_runs import run_cli


def recommendation(capsys, *argv):
    code, out, err = run_cli(capsys, "plan", "--json", *argv)
    assert code == 0, err
    plan = json.loads(out)
    return plan, plan["recommendation"]


def text(capsys, *argv):
    code, out, err = run_cli(capsys, "plan", *argv)
    assert code == 0, err
    return out


def one_link_rows(plan, rec):
    """The time table rows the recommendation was chosen from."""
    name = rec["basis"].split(" table")[0].split("the ")[-1]
    return plan["time"][name]["rows"]


@pytest.mark.parametrize("argv, algo, variant", [
    ([], "ulysses", "laga+overlap"),                        # DeepSeek-V3, 16k, CP 8 in one node
    (["--num-docs", "16"], "allgather", "laga+trim"),      # documents: trim the rebuild
    (["--device-memory", "8", "--num-layers", "4", "--seq-len", "131072"],
     "allgather", "laga+blockwise"),                       # 128k: only the blockwise path fits
])
def test_recommendation_is_the_fastest_that_fits(capsys, argv, algo, variant):
    plan, rec = recommendation(capsys, *argv)
    best = rec["best"]
    assert (best["cp_algo"], best["variant"]) == (algo, variant)
    rows = one_link_rows(plan, rec)
    fastest = min(t["total_s"] for a in rows for v, t in rows[a].items()
                  if v != "absorbed" and (not argv[:1] == ["--device-memory"] or
                                          "blockwise" in v or "recompute" in v))
    assert best["total_s"] == pytest.approx(fastest, rel=1e-12)
    assert rows[algo][variant]["total_s"] == pytest.approx(best["total_s"], rel=1e-12)
    # the tables below are the recommended algorithm's
    assert list(plan["algos"]) == [algo]
    explicit = rec["explicit"]
    assert (explicit["cp_algo"], explicit["variant"]) == (algo, "explicit")
    assert explicit["wire_bytes"] > best["wire_bytes"]


def test_recommendation_names_flags_savings_and_why(capsys):
    out = text(capsys, "--num-docs", "16")
    tail = out[out.index("\nrecommendation ("):]
    assert "laga+trim with cp_algo=allgather" in tail
    assert ("flags: --context-parallel-algo kvallgather_cp_algo --mla-latent-all-gather\n"
            "    --mla-laga-trim-causal-prefix") in tail
    assert "against the host's explicit path (allgather): time 3.39 ms vs 15.21 ms" in tail
    assert "bytes sent 31.50 MiB vs 2.188 GiB (71.11x fewer)" in tail
    assert "the host's fastest explicit setting here is cp_algo=ulysses (6.22 ms)" in tail
    # the runner-up is the next algorithm of the registry's tables (ulysses, or a new one tied)
    assert "why: the latent crosses the link" in tail and "why allgather over " in tail
    # the rebuild-extra line is explained where it is large
    assert "(extra = 559% of causal attention FLOPs)" in out
    assert "the share grows with the number of documents" in out


def test_recommendation_honours_cp_algo(capsys):
    plan, rec = recommendation(capsys, "--cp-algo", "allgather")
    assert rec["best"]["cp_algo"] == "allgather"  # ulysses would be faster, but was not asked
    for machine in plan["time"].values():
        assert set(machine["rows"]) == {"allgather"}
    plan, rec = recommendation(capsys, "--cp-algo", "hybrid", "--ulysses-degree", "4")
    assert (rec["best"]["cp_algo"], rec["best"]["ulysses_degree"]) == ("hybrid", 4)
    assert "--context-parallel-algo hybrid_cp_algo --ulysses-degree-in-cp 4" in rec["best"]["flags"]


def test_node_table_recommends_hybrid_at_128k(capsys):
    """128k on two 8-NPU nodes: the node table decides, and the answer is one (hybrid U=8),
    where the one-link tables alone named others."""
    plan, rec = recommendation(capsys, "--npus-per-node", "8", "--seq-len", "131072")
    assert rec["basis"].startswith("the node table")
    assert (rec["best"]["cp_algo"], rec["best"]["ulysses_degree"], rec["best"]["variant"]) == \
        ("hybrid", 8, "laga+overlap")
    timed = [r for r in plan["nodes"]["rows"] if "error" not in r and r["variant"] != "absorbed"]
    assert rec["best"]["total_s"] == pytest.approx(min(r["total_s"] for r in timed), rel=1e-12)
    out = text(capsys, "--npus-per-node", "8", "--seq-len", "131072")
    assert "fastest:" not in out and out.count("recommendation (") == 1


def test_cp_1_says_it_once(capsys):
    out = text(capsys, "--cp", "1")
    assert "fastest:" not in out
    assert out.count("recommendation") == 1
    assert "CP=1 exchanges nothing" in out


def _laga_flags(name):
    from mindspeed_laga.tools.commands.recommend import training_flags
    from mindspeed_laga.tools.runspec import standard_runs
    from mindspeed_laga.tools import costmodel as cm
    cfg = cm.Config(cm.preset("deepseek-v3"), 4096, cp_size=4, cp_algo=name,
                    ulysses_degree=2 if ALGOS[name].takes_ulysses_degree else 1)
    return training_flags(cfg, next(v for v in standard_runs(1024) if v.form == "laga"))


@pytest.mark.parametrize("name", list(ALGOS))
def test_every_algorithm_names_the_host_algorithm_that_runs_it(name):
    """plan's training flag is the algorithm's own ``host_algo``, and MindSpeed-LLM's flag map
    (features/laga_args.py) takes that value back to an algorithm that names the same one;
    ``host_algo=""`` (no host counterpart) gets no training flags at all."""
    from mindspeed_laga.features.laga_args import CP_ALGO_MAP
    a = ALGOS[name]
    if not a.host_algo:
        assert _laga_flags(name).startswith("none (") and "--mla" not in _laga_flags(name)
        return
    assert _laga_flags(name).startswith(f"--context-parallel-algo {a.host_algo} ")
    assert ALGOS[CP_ALGO_MAP[a.host_algo][0]].host_algo == a.host_algo


def _own_gather(monkeypatch):
    """allgather again under a new name, with no host counterpart (``host_algo = ""``)."""
    from mindspeed_laga import cp_algos
    own = type("OwnGather", (cp_algos.AllGather,), {"name": "own_gather", "host_algo": ""})()
    monkeypatch.setitem(cp_algos.ALGOS, own.name, own)
    return own


def test_an_algorithm_with_no_host_counterpart_gets_no_training_flags(monkeypatch):
    """``host_algo = ""``: no MindSpeed flag and no recipe variables, where allgather (the
    same algorithm with its host counterpart) gets both."""
    from mindspeed_laga.tools.commands import recommend
    from mindspeed_laga.tools.runspec import standard_runs
    from mindspeed_laga.tools import costmodel as cm
    _own_gather(monkeypatch)
    laga = next(v for v in standard_runs(1024) if v.form == "laga")
    cfg = cm.Config(cm.preset("deepseek-v3"), 4096, cp_size=4, cp_algo="own_gather")
    flags = recommend.training_flags(cfg, laga)
    assert flags.startswith("none (") and "--mla" not in flags, flags  # no flag to pass
    assert recommend.recipe_env(cfg, laga) is None
    host = cm.Config(cm.preset("deepseek-v3"), 4096, cp_size=4, cp_algo="allgather")
    assert "--mla-latent-all-gather" in recommend.training_flags(host, laga)
    assert recommend.recipe_env(host, laga).startswith("CP=4 CP_TYPE=kvallgather_cp_algo ")


def test_an_exact_tie_is_called_a_tie(monkeypatch):
    """Two algorithms with the same figures: the recommendation's why says a tie, not that
    one has less communication."""
    from dataclasses import replace
    from mindspeed_laga.tools.commands import recommend
    from mindspeed_laga.tools.runspec import standard_runs
    from mindspeed_laga.tools import costmodel as cm
    _own_gather(monkeypatch)
    base = cm.Config(cm.preset("deepseek-v3"), 16384, cp_size=8)
    machine = cm.MACHINES["910b-intra-node"]
    rec = recommend.recommend([replace(base, cp_algo=a) for a in ("allgather", "own_gather")],
                              standard_runs(2048), lambda c, s: cm.estimate_seconds(c, s, machine), "x")
    assert rec["best"]["total_s"] == rec["runner_up"]["total_s"]
    why = recommend._why_algo(rec["best"], rec["runner_up"])
    assert "a tie" in why and "less co" not in why, why

"""The cost model's hybrid CP rows against the running core.

Four gloo ranks, Ulysses groups of U=2 ({0,1}, {2,3}), every form and LAGA's
options, both layouts: the byte counter's records per (group, kind,
direction), both measures, and the saved-tensor hooks and FlopCounterMode of
each rank are the expected values; the model must equal them exactly. The
node split and the two-link time are checked on hand-built placements.
"""
import json
import math
import re

import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from mindspeed_laga import api, layout
from mindspeed_laga.tools import costmodel as cm
from mindspeed_laga.tools.costmodel.cluster import group_members, group_nodes, link_bytes
from mindspeed_laga import comm
from mindspeed_laga.comm import count_bytes
from mindspeed_laga.tools.measure import SavedBytes
from mindspeed_laga.tools.runspec import RunSpec
from mindspeed_laga.tools.spawn import run_on_ranks
from mindspeed_laga.tools.cases import MLAShape, full_inputs as shape_inputs
from mindspeed_laga.vocab.dims import ModelDims
from support.cli_runs import assert_one_line_error, run_cli


pytestmark = pytest.mark.timeout(600)

WORLD, DEGREE = 4, 2
S, B, N, D_N, D_R, D_V, D_C = 32, 2, 8, 8, 4, 8, 16
DIMS = ModelDims(heads=N, qk_head_dim=D_N, rope_dim=D_R, v_head_dim=D_V, kv_lora_rank=D_C)
SCALE = 1 / math.sqrt(D_N + D_R)
SHAPE = MLAShape(seq_len=S, batch=B, heads=N, qk_head_dim=D_N, rope_dim=D_R, v_head_dim=D_V,
                 kv_lora_rank=D_C)
SPECS = [RunSpec.from_options("explicit", "explicit", ()), RunSpec.from_options("absorbed", "absorbed", ()),
         RunSpec.from_options("laga", "laga", ()),
         RunSpec.from_options("laga+trim", "laga", (("trim_causal_prefix", True),)),
         RunSpec.from_options("laga+recompute", "laga", (("recompute_kv", True),)),
         RunSpec.from_options("laga+blockwise", "laga", (("recompute_kv", True), ("kv_block_size", 6),
                                                         ("trim_causal_prefix", True)))]
CASES = [(spec, lay) for spec in SPECS for lay in ("zigzag", "contiguous")]


def _run(rank, world, degree, group, spec, lay):
    x = {k: t.float() for k, t in shape_inputs(SHAPE, seed=5).items()}
    full = {"query": x["query"], "kv_latent": x["kv_latent"], "k_pos_emb": x["k_pos_emb"],
            "d_out": x["grad_out"]}
    local = {k: layout.shard(v, lay, world, rank, ulysses_degree=degree) for k, v in full.items()}
    inputs = {k: local[k].clone().requires_grad_(True) for k in ("query", "kv_latent", "k_pos_emb")}
    weight = x["kv_up_weight"].requires_grad_(True)  # scaled by D_C**-0.5 = 1/4
    saved = SavedBytes(exclude=[weight])
    with count_bytes() as counter, FlopCounterMode(display=False) as flops:
        with saved:
            out = api.FORMS[spec.form](inputs["query"], inputs["kv_latent"], inputs["k_pos_emb"], weight,
                                       softmax_scale=SCALE, cp_group=dist.group.WORLD, cp_algo="hybrid",
                                       layout=lay, kernel="eager",
                                       ulysses_group=group, **spec.options())
        out.backward(local["d_out"])
    traffic = {}
    for r in counter.records:
        if r.kind == "handshake":
            continue
        slot = traffic.setdefault((r.group, r.kind, r.direction), [0, 0, r.group_size])
        slot[0] += r.payload
        slot[1] += r.wire
    return {"traffic": traffic, "saved": saved.bytes, "flops": flops.get_total_flops()}


def _worker(rank, world, degree):
    group = comm.ulysses_group(dist.group.WORLD, degree)
    return [_run(rank, world, degree, group, spec, lay) for spec, lay in CASES]


@pytest.fixture(scope="module")
def measured():
    return run_on_ranks(_worker, WORLD, DEGREE, timeout_s=400)


def _config(lay, kernel=cm.EAGER):
    cfg = cm.Config(DIMS, S, B, WORLD, 1, "hybrid", lay, "float32", kernel, True, ulysses_degree=DEGREE)
    cm.validate(cfg, SPECS)
    return cfg


def _model_traffic(cost):
    out = {}
    for c in cost.comm:
        slot = out.setdefault((c.group, c.kind, c.direction), [0, 0, c.group_size])
        slot[0] += c.payload
        slot[1] += c.wire
    return out


@pytest.mark.parametrize("index", range(len(CASES)), ids=lambda i: f"{CASES[i][0].name}-{CASES[i][1]}")
def test_hybrid_model_equals_counter_hooks_and_flop_counter(measured, index):
    spec, lay = CASES[index]
    for rank in range(WORLD):
        got = measured[rank][index]
        cost = cm.form_cost(_config(lay), spec, rank)
        assert _model_traffic(cost) == got["traffic"], (spec.name, lay, rank)
        assert cost.saved_bytes == got["saved"], (spec.name, lay, rank, [(t.name, t.bytes) for t in cost.saved])
        f = cost.flops
        assert f["attention_fwd"] + f["attention_bwd"] + f["rebuild_fwd"] + f["rebuild_bwd"] == got["flops"], \
            (spec.name, lay, rank, f)


def test_counter_sees_the_three_groups(measured):
    """Explicit's K/V gather runs over the ring (R=2); LAGA's latent over the whole CP group."""
    by_name = {(spec.name, lay): i for i, (spec, lay) in enumerate(CASES)}
    explicit = measured[0][by_name[("explicit", "zigzag")]]["traffic"]
    laga = measured[0][by_name[("laga", "zigzag")]]["traffic"]
    assert {k[0] for k in explicit} == {"ulysses", "ring"}
    assert {k[0] for k in laga} == {"ulysses", "cp"}
    assert explicit[("ring", "all_gather", "forward")][2] == WORLD // DEGREE


# ---------------------------------------------------------------- nodes and links

V3 = cm.preset("deepseek-v3")


def _v3(algo, cp=16, degree=1, seq=131072):
    return cm.Config(V3, seq, 1, cp, 1, algo, None, "bfloat16", cm.FUSED, True, ulysses_degree=degree)


def test_group_members_and_nodes():
    cfg = _v3("hybrid", degree=8)
    assert group_members(cfg, 10, "ulysses") == list(range(8, 16))
    assert group_members(cfg, 10, "ring") == [2, 10]
    assert group_members(cfg, 10, "cp") == list(range(16))
    assert group_nodes(cfg, [2, 10], devices_per_node=8) == [0, 1]
    # TP ranks sit between CP ranks (TP innermost): CP=4 x TP=2 fills one 8-device node.
    tp2 = cm.Config(V3, 4096, 1, 4, 2, "ulysses", None, "bfloat16", cm.FUSED, True)
    assert group_nodes(tp2, [0, 1, 2, 3], devices_per_node=8) == [0, 0, 0, 0]
    assert group_nodes(tp2, [0, 1, 2, 3], devices_per_node=4) == [0, 0, 1, 1]


def test_link_split_of_each_collective():
    cluster = cm.Cluster("test", intra_gbps=100.0, inter_gbps=10.0, tflops=100.0, devices_per_node=8)
    hybrid = cm.form_cost(_v3("hybrid", degree=8), RunSpec.from_options("laga", "laga", ()), 0)
    for c in hybrid.comm:
        intra, inter = link_bytes(_v3("hybrid", degree=8), c, 0, cluster)
        if c.group == "ulysses":      # inside the node
            assert (intra, inter) == (c.wire, 0)
        else:                         # the latent over both nodes: a ring with cross-node hops
            assert (intra, inter) == (0, c.wire)
    ulysses = _v3("ulysses")
    for c in cm.form_cost(ulysses, RunSpec.from_options("laga", "laga", ()), 0).comm:
        intra, inter = link_bytes(ulysses, c, 0, cluster)
        if c.kind == "all_to_all":    # 1/16 of the payload to each of 7 node peers and 8 remote ranks
            assert (intra, inter) == (7 * c.payload // 16, 8 * c.payload // 16)
    # A Ulysses group across nodes is reported.
    assert cm.ulysses_fits_node(_v3("hybrid", degree=8), 8)
    assert not cm.ulysses_fits_node(_v3("hybrid", degree=16), 8)


def test_two_link_time_prefers_intra_node_all_to_all():
    """Same bytes, same FLOPs: the hybrid's all-to-all on the fast link beats ulysses over 16."""
    cluster = cm.CLUSTERS["910b"]
    laga = RunSpec.from_options("laga", "laga", ())
    times = {}
    for name, cfg in (("ulysses", _v3("ulysses")), ("hybrid", _v3("hybrid", degree=8))):
        times[name] = cm.estimate_cluster_seconds(cfg, cm.summarize(cfg, laga), cluster)
    u, h = times["ulysses"], times["hybrid"]
    assert h.inter_bytes < u.inter_bytes and h.total_s < u.total_s
    assert h.comm_s == pytest.approx(h.intra_bytes / (cluster.intra_gbps * 1e9)
                                     + h.inter_bytes / (cluster.inter_gbps * 1e9))


# ---------------------------------------------------------------- plan

V3_131K = ("--seq-len", "131072", "--cp", "16", "--npus-per-node", "8")


def test_plan_node_table_at_deepseek_v3_two_nodes(capsys):
    """S=131072 on CP=16 over two 8-NPU nodes, bf16: s = 8192 tokens a rank.
    LAGA hybrid U=8: Q (128 heads x 192) and O (128 x 128) all-to-all inside the
    node (7/8 of each leaves the rank), the 576-wide latent ring-gathered over
    both nodes (15 shards); fwd and bwd alike."""
    code, out, err = run_cli(capsys, "plan", *V3_131K, "--ulysses-degree", "8", "--json")
    assert code == 0, err
    nodes = json.loads(out)["nodes"]
    rows = {(r["cp_algo"], r["ulysses_degree"], r["variant"]): r for r in nodes["rows"]}
    s, e = 8192, 2
    hybrid = rows[("hybrid", 8, "laga")]
    assert hybrid["intra_bytes"] == 2 * (s * 128 * 192 * e + s * 128 * 128 * e) * 7 // 8
    assert hybrid["inter_bytes"] == 2 * 15 * s * 576 * e
    # ulysses over 16 ranks: of each all-to-all, 7 peers share the node, 8 do not.
    ulysses = rows[("ulysses", 1, "laga")]
    a2a = s * 128 * 192 * e + s * 128 * 128 * e
    assert ulysses["intra_bytes"] == 2 * a2a * 7 // 16
    assert ulysses["inter_bytes"] == 2 * a2a * 8 // 16 + 2 * 15 * s * 576 * e
    # explicit hybrid: Q, K, V, O inside the node, its per-head K/V over the 2-rank ring.
    explicit = rows[("hybrid", 8, "explicit")]
    assert explicit["inter_bytes"] == 2 * s * 128 * (192 + 128) * e
    assert ("allgather", 1, "laga") in rows
    fastest = nodes["fastest"]
    assert (fastest["cp_algo"], fastest["ulysses_degree"]) == ("hybrid", 8)
    assert fastest["total_s"] == min(r["total_s"] for r in nodes["rows"])
    code, out, _ = run_cli(capsys, "plan", *V3_131K, "--ulysses-degree", "8")
    assert "hybrid U=8     laga " in out
    assert "recommendation (the node table" in out and "with cp_algo=hybrid U=8" in out


def test_plan_hybrid_tables_and_spanning_note(capsys):
    code, out, err = run_cli(capsys, "plan", "--cp", "16", "--seq-len", "131072",
                             "--cp-algo", "hybrid", "--ulysses-degree", "8", "--npus-per-node", "4",
                             "--kernel", "fused")
    assert code == 0, err
    assert "cp_algo=hybrid (layout zigzag, U=8)" in out
    assert "note: U=8 does not fit in a node of 4 devices" in out


@pytest.mark.parametrize("argv,message", [
    (("--cp-algo", "hybrid"), "--cp-algo hybrid needs --ulysses-degree"),
    (("--cp", "16", "--ulysses-degree", "3"), "ulysses_degree=3 must be a positive divisor of CP=16"),
    (("--cp", "16", "--ulysses-degree", "0"), "--ulysses-degree must be positive"),
    (("--npus-per-node", "-8"), "--npus-per-node must be positive"),
])
def test_plan_hybrid_errors(capsys, argv, message):
    code, out, err = run_cli(capsys, "plan", *argv)
    assert_one_line_error("plan", code, err, message)


# ---------------------------------------------------------------- bench

def test_bench_hybrid_rows(tmp_path, capsys):
    """bench --cp-algo hybrid: spawned ranks build the Ulysses groups; every row is right
    against the float64 reference and its bytes per group and saved bytes equal the model."""
    from mindspeed_laga.tools import cli
    out_json = tmp_path / "bench.json"
    code = cli.main(["bench", "--cp", "4", "--cp-algo", "hybrid", "--ulysses-degree", "2",
                     "--seq-lens", "32", "--repeat", "1", "--warmup", "0", "--json", str(out_json),
                     "--plot", "", "--heads", "8", "--kv-lora-rank", "16"])
    assert code == 0
    rows = json.loads(out_json.read_text())["rows"]
    assert {r["variant"] for r in rows} >= {"explicit", "absorbed", "laga", "laga+overlap"}
    for r in rows:
        assert r["cp_algo"] == "hybrid" and r["ulysses_degree"] == 2
        assert r["max_rel_err"] < 1e-4, (r["variant"], r["max_rel_err"])
        assert r["comm_wire_by_group"] == r["model_comm_wire_by_group"], r["variant"]
        assert r["saved_bytes"] == r["model_saved_bytes"], r["variant"]
        assert r["peak_bytes"] > 0, r["variant"]  # the CPU allocator's peak, every rank's pass
    groups = {r["variant"]: set(r["comm_wire_by_group"]) for r in rows}
    assert groups["explicit"] == {"ulysses", "ring"} and groups["laga"] == {"ulysses", "cp"}
    text = capsys.readouterr().out
    assert "cp_algo=hybrid U=2" in text
    # one vocabulary in the table: every row names the same three groups, in one order
    by_group = [line.split(":", 1)[1] for line in text.splitlines() if "wire by group" in line]
    assert len(by_group) == len(rows)
    assert {tuple(re.findall(r"([a-z]+) [\d,]+ / [\d,]+", line)) for line in by_group} == \
        {("ulysses", "ring", "cp")}
    assert "groups: ulysses = the 2 ranks" in text


def test_plan_hybrid_keeps_the_one_link_estimates(capsys):
    code, out, err = run_cli(capsys, "plan", "--cp", "16", "--seq-len", "131072",
                             "--cp-algo", "hybrid", "--ulysses-degree", "8", "--kernel", "fused")
    assert code == 0, err
    assert "n/a" not in out and "fastest:" not in out
    # two one-link tables and the node table, each with hybrid's rows; one recommendation
    assert len(re.findall(r"\n  variant +hybrid U=8\n", out)) == 2 and "hybrid U=8     laga " in out
    assert out.count("recommendation (") == 1

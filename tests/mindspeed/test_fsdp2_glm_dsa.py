"""GLM-5.2 on MindSpeed-LLM's FSDP2 backend: LAGA's sparse form against the host's real
``GlmMoeDsaAttention`` (release 26.1.0's ``mindspeed_llm/fsdp2/models/glm52/``), on CPU.

Harness: tests/support/fsdp2_glm.py. Three shrunk layers (full, shared, full: GLM-5.2's
shared picks handed on as the model's loop hands them) at CP 2 and 4, under both of the
backend's batch splits (``cp_type`` ulysses: contiguous, ring: zigzag), with the torch
path and with the recipe's fused ops and indexer loss; forward and backward in float64
against the host's own forward at CP 1: the output, the input's grad, every weight's grad
(summed over the CP ranks) and each layer's indexer loss (the mean of the ranks'), all to
2e-6 of their largest value (the loss to 2e-7: the host tracks it in float32).

On the third micro-batch every later layer call does one all-gather and no host read, the
backward one reduce-scatter per layer and no host read; the gather carries 704 values per
token on a computing layer and 576 on the shared one (GLM-5.2's dims: latent 512, rope 64,
index key 128); no op of LAGA's forward or backward makes a tensor with two dimensions of
the sequence's length, where the host's CP 1 forward makes its ``[b, 1, S, S]`` mask.

Mutants tried (fused, ulysses, CP 2), each failing the comparison: the index key of the
neighbouring position (output 0.63 relative), the rope one position off (output 0.17),
the index inputs built without a gradient (every indexer weight's grad missing).
"""
import json
import math

import pytest

pytestmark = [pytest.mark.ascend, pytest.mark.hosts]

CASES = [("ulysses", False, 2), ("ring", False, 4), ("ulysses", True, 4), ("ring", True, 2)]


@pytest.fixture(scope="module")
def harness():
    from support import fsdp2_glm
    return fsdp2_glm


@pytest.fixture(scope="module")
def around():
    from support import fsdp2_glm_host
    return fsdp2_glm_host


@pytest.fixture(scope="module")
def roots(harness):
    return harness.sources()


@pytest.fixture(scope="module")
def references(harness, roots):
    return {fused: harness.host_reference(roots, fused) for fused in (False, True)}


def _case_id(case):
    cp_type, fused, size = case
    return f"{cp_type}-{'fused' if fused else 'torch'}-cp{size}"


@pytest.fixture(scope="module", params=CASES, ids=_case_id)
def case(request, harness, roots, references):
    cp_type, fused, size = request.param
    return references[fused], harness.run_laga(roots, cp_type, fused, size), size


@pytest.mark.timeout(900)
def test_equals_the_hosts_forward_at_cp1(harness, case):
    ref, per_rank, size = case
    assert harness.mismatches(ref, per_rank, size) == []
    assert all(r["losses"][1] is None for r in per_rank)  # a shared layer trains no indexer


@pytest.mark.timeout(900)
def test_picks_are_the_hosts(case):
    ref, per_rank, _ = case
    for layer in range(3):
        for r in per_rank:
            for j, q in enumerate(r["rows"].tolist()):
                mine = {int(v) for v in r["picks"][layer][0, j] if v >= 0}
                host = {int(v) for v in ref["picks"][layer][0, q] if 0 <= v <= q}
                assert mine == host, (layer, q)


@pytest.mark.timeout(900)
def test_steady_state_per_later_layer_call(case):
    _, per_rank, _ = case
    for r in per_rank:
        assert r["kinds"]["layer1"] == {"all_gather": 1}
        assert r["kinds"]["layer2"] == {"all_gather": 1}
        assert r["kinds"]["backward"] == {"reduce_scatter": 3}
        assert (r["syncs"]["layer1"], r["syncs"]["layer2"], r["syncs"]["backward"]) == (0, 0, 0)


def planned(harness, capsys, *more):
    """``mindspeed-laga plan --backend fsdp2 --json`` at the harness's dims."""
    from support.cli_runs import run_cli
    code, out, err = run_cli(capsys, "plan", "--backend", "fsdp2", "--json", *harness.plan_flags(),
                             *more)
    assert code == 0, err
    return json.loads(out)["fsdp2"]


@pytest.mark.timeout(900)
def test_values_per_token(case, harness, capsys):
    _, per_rank, _ = case
    plan = planned(harness, capsys)["paths"]
    computing, reusing = (plan[p]["values_per_token"] for p in ("laga", "laga, reusing picks"))
    for r in per_rank:
        assert r["values_per_token"] == {"layer0": 704.0, "layer1": 576.0, "layer2": 704.0}
        assert r["values_per_token"] == {"layer0": computing, "layer1": reusing, "layer2": computing}


@pytest.mark.timeout(900)
def test_no_sequence_square(case):
    ref, per_rank, _ = case
    assert ref["square"], "the watcher sees the host's [b, 1, S, S] mask"
    for r in per_rank:
        assert r["square"] == []


REFUSED = {"transformers' class": "model.model_id: glm52",
           "a split kv_b_proj": "parallel.tp_size 1", "a KV cache": "use_cache=False",
           "a shared layer without picks": "prev_topk_indices",
           "an unknown cp_type": "parallel.cp_type"}


@pytest.mark.timeout(600)
def test_refusals_name_the_fix_on_every_rank_before_any_collective(around, roots):
    for errors, collectives in around.refusals(roots):
        assert collectives == {}
        for name, words in REFUSED.items():
            assert errors[name] is not None and words in errors[name], (name, errors[name])


@pytest.mark.timeout(600)
def test_the_hosts_cp_path_gathers_every_hidden_state(harness, around, roots, capsys):
    """The host's figures, for comparison: its ``dsa_forward`` (on transformers' class, as
    its CP table maps it) all-gathers per token the hidden state, the query latent, cos and
    sin, then moves per-head Q, K, V and the output by all-to-all, and builds tensors with
    two dims of the sequence's length (its indexer's scores, its dense mask)."""
    c = harness.CONFIG
    heads, qk = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    for per_token, square in around.host_cp(roots):
        assert per_token["all_gather"] == [c["hidden_size"], c["q_lora_rank"],
                                           c["qk_rope_head_dim"], c["qk_rope_head_dim"]]
        assert per_token["all_to_all"] == [heads * qk, heads * qk, heads * c["v_head_dim"],
                                           heads * c["v_head_dim"]]
        assert square
        plan = planned(harness, capsys, "--dtype", "fp32")  # the layer runs in float32
        host = plan["paths"]["host dsa_forward"]["transfers"]
        assert {kind: [x["width"] for x in host if x["kind"] == kind] for kind in per_token} == per_token
        made = {op: [math.prod(shape) for o, shape in square if o == op] for op, _ in square}
        index_scores = harness.BATCH * harness.SEQ * c["index_n_heads"] * harness.SEQ
        assert [n * 4 for n in made["aten.full.default"]] == [plan["host_squares"]["index_mask"]]
        assert made["aten._to_copy.default"] == [plan["host_squares"]["index_mask_bool"]]
        assert index_scores in made["aten.mul.Tensor"]  # the indexer's [b, S, heads, S] scores
        assert index_scores * 4 == plan["host_squares"]["indexer_scores"]


@pytest.mark.timeout(600)
def test_the_hosts_cp_table_leaves_the_glm52_model_as_it_is(around, roots):
    """The recipe's model (``model_id: glm52``) is MindSpeed-LLM's own class; the host's CP
    table replaces transformers' ``GlmMoeDsaAttention.forward`` only, so under its
    ``cp_size`` > 1 the glm52 attention is not made context parallel: LAGA's forward is
    what gives it CP."""
    assert around.hosts_mapping(roots) == (False, True)

"""Sparse MLA (DSA) under CP with one gather: equal to a single-process reference.

At CP 1, 2 and 4, in both layouts (contiguous: ulysses, kvallgather with documents; zigzag:
kvallgather), the output, the top-k picks, the indexer loss and every grad (local
inputs, index ones included, and the up-projection weight) equal the float64 reference
of tests/support/sparse_mla.py; a tie (every index key the same) resolves to the lowest
positions on every rank and CP size; the byte counter sees one all-gather of
[kv_latent | k_pos_emb | index_key] forward and one reduce-scatter backward.
"""
import pytest
import torch

from mindspeed_laga import agreement
from mindspeed_laga.sparse.form import sparse_laga_attention
from mindspeed_laga.tools.spawn import run_on_ranks
from support import sparse_mla as sm

# (seed, tie): two random inputs and the tie
CASES = [(0, False), (1, False), (2, True)]
# the attention runs in float64; the indexer's products and its loss in float32
ATOL = {"output": 1e-10, "query": 1e-10, "kv_latent": 1e-10, "k_pos_emb": 1e-10,
        "kv_up_weight": 1e-10, "index_query": 1e-6, "index_key": 1e-6, "index_weights": 1e-6}


@pytest.fixture(scope="module")
def references():
    return [sm.reference(sm.full_inputs(seed, tie)) for seed, tie in CASES]


@pytest.fixture(scope="module", params=[(1, "contiguous"), (2, "contiguous"), (2, "zigzag"),
                                        (4, "contiguous"), (4, "zigzag")],
                ids=lambda p: f"cp{p[0]}-{p[1]}")
def measured(request):
    cp_size, layout = request.param
    per_rank = run_on_ranks(sm.worker, cp_size, layout, CASES, timeout_s=120)
    return cp_size, layout, per_rank


def _close(name, got, want):
    scale = want.abs().max().item()
    assert scale > 0, f"{name}: the reference is all zero"
    err = (got - want).abs().max().item()
    assert err <= ATOL.get(name, 1e-10) * max(1.0, scale), (name, err, scale)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("index", range(len(CASES)), ids=["seed0", "seed1", "tie"])
def test_equals_reference(measured, references, index):
    cp_size, layout, per_rank = measured
    got, want = sm.assemble(per_rank, index, layout), references[index]
    assert torch.equal(got["topk_indices"], want["topk_indices"])
    _close("output", got["output"], want["output"])
    assert abs(got["loss"].item() - want["loss"].item()) <= 1e-6 * abs(want["loss"].item())
    for name, grad in want["grads"].items():
        _close(name, got["grads"][name], grad)


@pytest.mark.timeout(200)
def test_tie_picks_lowest_positions(measured, references):
    """Every key scores alike: row i picks 0, 1, ... up to i, then -1, on every rank."""
    cp_size, layout, per_rank = measured
    picks = sm.assemble(per_rank, CASES.index((2, True)), layout)["topk_indices"]
    rows = torch.arange(sm.S).view(1, -1, 1)
    ranks = torch.arange(sm.TOPK).view(1, 1, -1)
    expected = torch.where(ranks <= rows, ranks, torch.full_like(ranks, -1)).expand_as(picks)
    assert torch.equal(picks, expected)
    assert torch.equal(references[CASES.index((2, True))]["topk_indices"], expected)


@pytest.mark.timeout(200)
def test_one_gather_one_reduce_scatter(measured):
    """Per call: one all-gather of d_c + d_r + D values per local token forward, one
    reduce-scatter of the same backward, nothing else but the ranks' agreement (one row of
    int64 per rank, exchanged on every call here: the workers open no micro-batch)."""
    cp_size, _, per_rank = measured
    tokens = sm.S // cp_size * sm.B
    width = (sm.D_C + sm.D_R + sm.INDEX_DIM) * tokens * 8
    expected = [("handshake", "forward", len(agreement.FIELDS) * 8),
                ("all_gather", "forward", width), ("reduce_scatter", "backward", width)]
    for ranks in per_rank:
        for run in ranks:
            assert run["records"] == (expected if cp_size > 1 else []), run["records"]


# DeepSeek-V3.2's dims: kv_lora_rank 512, rope 64, index head dim 128
V32 = dict(D_C=512, D_R=64, INDEX_DIM=128, S=8, B=1, HEADS=2, D_N=16, D_V=16, INDEX_HEADS=2)
# the host's kvallgather DSA path, per token and layer forward: index key, latent as K,
# latent as V, k_rope, and for the KL loss latent, index key, k_rope again
HOST_KVALLGATHER_VALUES = 128 + 512 + 512 + 64 + 512 + 128 + 64


@pytest.mark.timeout(200)
def test_counter_at_deepseek_v32_dims():
    per_rank = run_on_ranks(sm.worker, 2, "zigzag", [(0, False)], 4, V32, timeout_s=120)
    bf = 8  # float64 inputs
    for ranks in per_rank:
        (run,) = ranks
        forward = [p for kind, d, p in run["records"] if d == "forward" and kind != "handshake"]
        values = forward[0] / bf / (V32["S"] // 2 * V32["B"])
        assert len(forward) == 1 and values == 704, run["records"]
    assert HOST_KVALLGATHER_VALUES == 1920 and round(HOST_KVALLGATHER_VALUES / 704, 2) == 2.73


def test_errors_name_the_argument():
    x = {k: v[:4] for k, v in sm.full_inputs().items() if k != "kv_up_weight"}
    args = [x[k] for k in sm.LOCAL[:3]] + [sm.full_inputs()["kv_up_weight"]] + \
        [x[k] for k in sm.LOCAL[3:]]
    kw = dict(index_topk=3, softmax_scale=sm.SCALE, qk_head_dim=sm.D_N, v_head_dim=sm.D_V)
    with pytest.raises(ValueError, match="layout"):
        sparse_laga_attention(*args, layout="doc_zigzag", **kw)
    with pytest.raises(ValueError, match="index_topk"):
        sparse_laga_attention(*args, **{**kw, "index_topk": 0})
    bad = list(args)
    bad[5] = bad[5][..., :-1]  # index_key narrower than index_query
    with pytest.raises(ValueError, match="index_query"):
        sparse_laga_attention(*bad, **kw)
    bad = list(args)
    bad[2] = bad[2].float()
    with pytest.raises(ValueError, match="one gather"):
        sparse_laga_attention(*bad, **kw)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("cp_size,layout", [(1, "contiguous"), (2, "contiguous"), (4, "zigzag")])
def test_all_keys_target_equals_the_hosts_unmasked_target(cp_size, layout):
    """loss_target="all_keys": the target of MindSpeed-LLM's torch loss behind its sparse
    flash attention (no mask: every key, an empty pick reading the last one); the output
    and the attention's grads are those of the default target's run."""
    want = sm.reference(sm.full_inputs(0), all_keys=True)
    per_rank = run_on_ranks(sm.worker, cp_size, layout, [(0, False)], sm.TOPK, None,
                            {"loss_target": "all_keys"}, timeout_s=120)
    got = sm.assemble(per_rank, 0, layout)
    assert torch.equal(got["topk_indices"], want["topk_indices"])
    assert (want["topk_indices"] < 0).any()  # empty picks occur, and read the last key
    assert abs(got["loss"].item() - want["loss"].item()) <= 1e-6 * abs(want["loss"].item())
    _close("output", got["output"], want["output"])
    for name, grad in want["grads"].items():
        _close(name, got["grads"][name], grad)


def test_all_keys_target_is_the_torch_losss():
    x = sm.full_inputs(0)
    with pytest.raises(ValueError, match="loss_kernel='torch'"):
        sparse_laga_attention(*(x[k] for k in sm.LOCAL[:3]), x["kv_up_weight"],
                              *(x[k] for k in sm.LOCAL[3:]), index_topk=sm.TOPK,
                              softmax_scale=sm.SCALE, qk_head_dim=sm.D_N, v_head_dim=sm.D_V,
                              indexer_loss_coeff=sm.COEFF, loss_kernel="npu",
                              loss_target="all_keys")
    with pytest.raises(ValueError, match="loss_target must be one of"):
        sparse_laga_attention(*(x[k] for k in sm.LOCAL[:3]), x["kv_up_weight"],
                              *(x[k] for k in sm.LOCAL[3:]), index_topk=sm.TOPK,
                              softmax_scale=sm.SCALE, qk_head_dim=sm.D_N, v_head_dim=sm.D_V,
                              loss_target="unmasked")


@pytest.mark.timeout(200)
def test_zigzag_with_an_odd_local_length_is_refused_before_the_gather():
    """Every rank holds 5 tokens: zigzag's two equal chunks cannot be cut; each rank names
    the layout and its length, as the dense forms do, and no collective runs."""
    for message, records in run_on_ranks(sm.refusal_worker, 2, 5, "zigzag", timeout_s=120):
        assert message is not None and records == [], (message, records)
        assert "layout='zigzag'" in message and "2*CP=4" in message, message
        assert "holds 5 tokens" in message and "layout='contiguous'" in message, message
    # contiguous takes the odd length
    for message, _ in run_on_ranks(sm.refusal_worker, 2, 5, "contiguous", timeout_s=120):
        assert message is None, message


@pytest.mark.timeout(200)
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_inputs_are_refused_by_name(dtype):
    """As laga_attention refuses them: before the gather, naming the dtype and the fix."""
    for message, records in run_on_ranks(sm.refusal_worker, 2, 4, "zigzag", dtype,
                                         timeout_s=120):
        assert message is not None and records == [], (message, records)
        assert dtype in message and "bfloat16" in message and "query" in message, message

"""Misuse as a hostile-but-realistic user commits it: ranks that disagree raise the same
ValueError on every rank before a data collective (never hang, never wrong numbers);
shapes are never silently re-read; numbers are checked.

All two-rank scenarios run in one spawned job; each rank reports, per scenario,
the error text (or None) and how many data bytes moved before it.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mindspeed_laga import (agreement, count_bytes, explicit_attention, absorbed_attention,
                            laga_attention, start_latent_gather)
from mindspeed_laga import layout as layouts
from mindspeed_laga.tools.spawn import run_on_ranks
from mindspeed_laga.tools.cases import INPUTS, MLAShape, full_inputs as shape_inputs
from support.raise_together import assert_raised_together, outcome

S, B, N, D_N, D_R, D_V, D_C = 16, 1, 4, 8, 4, 8, 16
SCALE = (D_N + D_R) ** -0.5
FORMS = {"laga": laga_attention, "explicit": explicit_attention, "absorbed": absorbed_attention}


SHAPE = MLAShape(seq_len=S, batch=B, heads=N, qk_head_dim=D_N, rope_dim=D_R, v_head_dim=D_V,
                 kv_lora_rank=D_C)


def full_inputs(seed=0, dtype=torch.float32):
    x = shape_inputs(SHAPE, seed)
    return {k: x[k].to(dtype) for k in INPUTS}


def local_inputs(rank, world, layout="zigzag", grad=True):
    x = full_inputs()
    out = [layouts.shard(x[k], layout, world, rank) for k in ("query", "kv_latent", "k_pos_emb")]
    out.append(x["kv_up_weight"].clone())
    return [t.requires_grad_(grad) for t in out]


# scenario -> per-rank keyword differences (rank 0's, rank 1's)
RANK_DIFFERENCES = {
    "layout": ({"layout": "zigzag"}, {"layout": "contiguous"}),
    "causal": ({"causal": True}, {"causal": False}),
    "softmax_scale": ({"softmax_scale": SCALE}, {"softmax_scale": math.nextafter(SCALE, 1.0)}),
    "cp_algo": ({"cp_algo": "allgather"}, {"cp_algo": "ulysses"}),
    "form": ({"form": "laga"}, {"form": "explicit"}),
    "check_ranks": ({"check_ranks": True}, {"check_ranks": False}),
    "requires_grad": ({"grad": True}, {"grad": False}),
    "recompute_kv": ({"recompute_kv": True}, {"recompute_kv": False}),
    "kv_block_size": ({"recompute_kv": True, "kv_block_size": 4},
                      {"recompute_kv": True, "kv_block_size": 8}),
    "trim_causal_prefix": ({"trim_causal_prefix": True}, {"trim_causal_prefix": False}),
    "latent_gather": ({"overlap": True}, {"overlap": False}),
    "cu_seqlens": ({"cu_seqlens": [0, 8, 16]}, {"cu_seqlens": [0, 4, 16]}),
}
EXPECTED = {
    "layout": "disagree on layout: ['zigzag', 'contiguous']",
    "causal": "disagree on causal: [True, False]",
    "softmax_scale": "disagree on softmax_scale",
    "cp_algo": "disagree on cp_algo: ['allgather', 'ulysses']",
    "form": "disagree on form: ['laga', 'explicit']",
    "check_ranks": "disagree on check_ranks: [True, False]",
    "requires_grad": "disagree on which inputs need grads (requires_grad under grad mode): "
                     "[['query', 'kv_latent', 'k_pos_emb', 'kv_up_weight'], []]",
    "recompute_kv": "disagree on recompute_kv: [True, False]",
    "kv_block_size": "disagree on kv_block_size: [4, 8]",
    "trim_causal_prefix": "disagree on trim_causal_prefix: [True, False]",
    "latent_gather": "disagree on latent_gather",
    "cu_seqlens": "disagree on documents",
}


def _one_call(rank, world, kw):
    import torch.distributed as dist
    kw = dict(kw)
    form = FORMS[kw.pop("form", "laga")]
    layout = kw.setdefault("layout", "zigzag")
    q, kv, kpe, w = local_inputs(rank, world, layout, grad=kw.pop("grad", True))
    if kw.pop("overlap", False):
        kw["latent_gather"] = start_latent_gather(kv, kpe, cp_group=dist.group.WORLD)
    kw.setdefault("softmax_scale", SCALE)
    out = form(q, kv, kpe, w, cp_group=dist.group.WORLD, kernel="eager", **kw)
    if out.requires_grad:
        out.sum().backward()
    return out


def _scenario_worker(rank, world, names):
    return [outcome(_one_call, rank, world, RANK_DIFFERENCES[name][rank]) for name in names]


@pytest.fixture(scope="module")
def scenario_reports():
    names = sorted(RANK_DIFFERENCES)
    per_rank = run_on_ranks(_scenario_worker, 2, names, timeout_s=240)
    return {name: [per_rank[r][i] for r in range(2)] for i, name in enumerate(names)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(RANK_DIFFERENCES))
def test_ranks_that_disagree_raise_together(scenario_reports, name):
    assert_raised_together(scenario_reports[name], EXPECTED[name])


def _policy_worker(rank, world):
    """check_ranks=False on every rank, after one agreed exchange, skips the handshake."""
    agreement.reset()
    with count_bytes() as counter:
        for check in (True, False, False, False):
            _one_call(rank, world, {"check_ranks": check})
    return [r.kind for r in counter.records if r.kind == "handshake"]


@pytest.mark.timeout(120)
def test_check_ranks_false_everywhere_turns_the_exchange_off():
    for kinds in run_on_ranks(_policy_worker, 2, timeout_s=90):
        # call 1 (True) and call 2 (False everywhere, still exchanged) shake hands;
        # calls 3 and 4 skip it.
        assert kinds == ["handshake", "handshake"]


# ---------------------------------------------------------------- local misuse (one process)

def _call(form="laga", **override):
    x = full_inputs()
    x.update({k: v for k, v in override.items() if k in x})
    kw = {k: v for k, v in override.items() if k not in x}
    kw.setdefault("softmax_scale", SCALE)
    return FORMS[form](x["query"], x["kv_latent"], x["k_pos_emb"], x["kv_up_weight"], **kw)


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("width", [D_R + 1, D_R - 1])
def test_k_pos_emb_of_the_wrong_width_is_not_reread(form, width):
    x = full_inputs()
    with pytest.raises(ValueError, match="ambiguous|qk_pos_emb_head_dim"):
        _call(form, k_pos_emb=torch.randn(S, B, width))
    # with the config's head dims the same mistake is named directly
    with pytest.raises(ValueError, match="qk_pos_emb_head_dim"):
        _call(form, k_pos_emb=torch.randn(S, B, width), qk_head_dim=D_N, v_head_dim=D_V)
    assert x  # inputs unchanged


@pytest.mark.parametrize("form", sorted(FORMS))
def test_unsplit_kv_up_weight_is_not_reread(form):
    whole = torch.randn(2 * N * (D_N + D_V), D_C)  # both TP ranks' rows
    with pytest.raises(ValueError, match="ambiguous"):
        _call(form, kv_up_weight=whole)
    with pytest.raises(ValueError, match="the TP-split linear_kv_up_proj.weight"):
        _call(form, kv_up_weight=whole, qk_head_dim=D_N, v_head_dim=D_V)


def test_explicit_head_dims_that_match_run():
    torch.testing.assert_close(_call(qk_head_dim=D_N, v_head_dim=D_V), _call())


@pytest.mark.parametrize("scale", [True, float("nan"), float("inf"), -1.0, 0.0, "0.1"])
def test_softmax_scale_must_be_finite_positive_real(scale):
    with pytest.raises(ValueError, match="softmax_scale must be a positive, finite real number"):
        _call(softmax_scale=scale)


def test_numpy_scale_is_accepted():
    torch.testing.assert_close(_call(softmax_scale=np.float32(SCALE)),
                               _call(softmax_scale=float(np.float32(SCALE))))


@pytest.mark.parametrize("what,override", [
    ("S=0", {"query": torch.zeros(0, B, N, D_N + D_R), "kv_latent": torch.zeros(0, B, D_C),
             "k_pos_emb": torch.zeros(0, B, D_R)}),
    ("b=0", {"query": torch.zeros(S, 0, N, D_N + D_R), "kv_latent": torch.zeros(S, 0, D_C),
             "k_pos_emb": torch.zeros(S, 0, D_R)}),
    ("n=0", {"query": torch.zeros(S, B, 0, D_N + D_R), "kv_up_weight": torch.zeros(0, D_C)}),
])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_zero_size_inputs_raise_clearly(form, what, override):
    with pytest.raises(ValueError, match="zero-size dimension"):
        _call(form, **override)


@pytest.mark.parametrize("bad,message", [
    ([0, 8, 15], "from 0 to the full sequence length"),
    ([1, 8, 16], "from 0 to the full sequence length"),
    ([0, 8, 8, 16], "increase strictly"),
    ([0.0, 8.5, 16.0], "integer document boundaries"),
    (torch.tensor([0.0, 16.0]), "1-D integer tensor"),
])
def test_bad_cu_seqlens_named(bad, message):
    with pytest.raises(ValueError, match=message):
        _call(cu_seqlens=bad)


def test_cu_seqlens_needs_micro_batch_one():
    x = full_inputs()
    two = {k: torch.cat([v, v], dim=1) for k, v in x.items() if k != "kv_up_weight"}
    with pytest.raises(ValueError, match="micro-batch must be 1"):
        _call(cu_seqlens=[0, 16], **two)


def test_doc_zigzag_needs_documents():
    with pytest.raises(ValueError, match="layout='doc_zigzag' needs cu_seqlens"):
        _call(layout="doc_zigzag")
    with pytest.raises(ValueError, match="doc_zigzag' needs cu_seqlens"):
        layouts.shard(torch.zeros(16), "doc_zigzag", 2, 0)
    with pytest.raises(ValueError, match="pad each document to a multiple of 4"):
        layouts.shard(torch.zeros(16), "doc_zigzag", 2, 0, cu_seqlens=[0, 6, 16])


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
@pytest.mark.parametrize("options", [{"recompute_kv": True},
                                     {"recompute_kv": True, "kv_block_size": 5,
                                      "trim_causal_prefix": True}])
def test_float64_stays_float64_in_the_blockwise_path(kernel, options):
    """Accumulators follow the input dtype: float64 matches a float64 plain softmax
    attention to float64 accuracy (float32 accumulation would leave ~1e-7)."""
    x = {k: v.double().requires_grad_() for k, v in full_inputs().items()}
    out = laga_attention(x["query"], x["kv_latent"], x["k_pos_emb"], x["kv_up_weight"],
                         softmax_scale=SCALE, kernel=kernel, **options)
    assert out.dtype == torch.float64
    grads = torch.autograd.grad(out.sum(), list(x.values()))
    w = x["kv_up_weight"].view(N, D_N + D_V, D_C)
    k_nope = torch.einsum("sbc,ndc->sbnd", x["kv_latent"], w[:, :D_N])
    value = torch.einsum("sbc,nvc->sbnv", x["kv_latent"], w[:, D_N:])
    key = torch.cat([k_nope, x["k_pos_emb"][:, :, None].expand(S, B, N, D_R)], dim=-1)
    scores = torch.einsum("qbnd,kbnd->bnqk", x["query"], key) * SCALE
    future = torch.ones(S, S, dtype=torch.bool).triu(1)
    ref = torch.einsum("bnqk,kbnv->qbnv", scores.masked_fill(future, float("-inf")).softmax(-1),
                       value).reshape(S, B, N * D_V)
    ref_grads = torch.autograd.grad(ref.sum(), list(x.values()))
    assert (out - ref).abs().max().item() < 1e-12
    for got, want in zip(grads, ref_grads):
        assert (got - want).abs().max().item() < 1e-11

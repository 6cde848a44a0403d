"""A NaN (or inf) in one token's latent reaches exactly the rows that attend that token:
earlier rows under the causal mask and other packed documents stay finite, for every
form, kernel and LAGA option, without CP and on two ranks. The expected rows come from
the mask rule alone (row i sees token t iff t is in i's document and, causal, t <= i)."""
from __future__ import annotations

import pytest
import torch

from mindspeed_laga import layout as layouts
from mindspeed_laga.tools.spawn import run_on_ranks
from mindspeed_laga.tools.cases import INPUTS, MLAShape, full_inputs as shape_inputs
from support.variants import CPU_KERNELS, attention_variants

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

S, N, D_N, D_R, D_V, D_C = 16, 4, 8, 4, 8, 16
SCALE = (D_N + D_R) ** -0.5
SHAPE = MLAShape(seq_len=S, batch=1, heads=N, qk_head_dim=D_N, rope_dim=D_R, v_head_dim=D_V,
                 kv_lora_rank=D_C)
DOCS = [0, 6, 16]
RANK_DOCS = [0, 8, 16]  # doc_zigzag on 2 ranks: documents in multiples of 4
VARIANTS = attention_variants(kv_block_size=3)


def inputs(bad_token: int, where: str):
    full = shape_inputs(SHAPE, seed=0)
    x = [full[k].float() for k in INPUTS]
    if where == "kv_latent":
        x[1][bad_token, 0, 3] = float("nan")
    else:
        x[2][bad_token, 0, 1] = float("inf")
    return x


def sees(row: int, token: int, causal: bool, documents) -> bool:
    bounds = documents or [0, S]
    doc = next(i for i in range(len(bounds) - 1) if bounds[i] <= row < bounds[i + 1])
    same = bounds[doc] <= token < bounds[doc + 1]
    return same and (token <= row or not causal)


def expected_finite(token, causal, documents):
    return [not sees(i, token, causal, documents) for i in range(S)]


def _call(variant, tensors, kernel, causal, documents, **kw):
    fn, options = VARIANTS[variant]
    if options.get("recompute_kv") and kernel == "sdpa":
        kernel = "auto"
    return fn(*tensors, softmax_scale=SCALE, kernel=kernel, causal=causal, cu_seqlens=documents,
              **options, **kw)


CASES = [(v, k, c, d) for v in VARIANTS for k in CPU_KERNELS for c in (True, False)
         for d in (None, DOCS)]


@pytest.mark.parametrize("variant, kernel, causal, documents", CASES)
@pytest.mark.parametrize("where", ["kv_latent", "k_pos_emb"])
def test_a_non_finite_token_reaches_only_the_rows_that_attend_it(variant, kernel, causal,
                                                                 documents, where):
    token = 9
    x = inputs(token, where)
    before = [t.clone() for t in x]
    out = _call(variant, [t.requires_grad_() for t in x], kernel, causal, documents)
    finite = torch.isfinite(out[:, 0]).all(-1).tolist()
    assert finite == expected_finite(token, causal, documents)
    for t, b in zip(x, before):  # the caller's tensors are not cleaned in place
        assert torch.equal(t.detach().nan_to_num(7.0), b.nan_to_num(7.0))
    # the finite rows are what a clean input gives there (the bad token is invisible to them)
    clean = [t.detach().clone() for t in x]
    clean[1 if where == "kv_latent" else 2][token] = 0.0
    ref = _call(variant, clean, kernel, causal, documents)
    rows = torch.tensor(finite)
    torch.testing.assert_close(out[rows].detach(), ref[rows], rtol=1e-5, atol=1e-6)


def _ranks_worker(rank, world, variant, kernel, causal, documents, cp_algo):
    import torch.distributed as dist
    layout = "doc_zigzag" if documents else "zigzag"
    token = 9
    x = inputs(token, "kv_latent")
    local = [layouts.shard(t, layout, world, rank, cu_seqlens=documents) for t in x[:3]] + [x[3]]
    out = _call(variant, [t.requires_grad_() for t in local], kernel, causal, documents,
                cp_group=dist.group.WORLD, cp_algo=cp_algo, layout=layout)
    positions = layouts.shard(torch.arange(S), layout, world, rank, cu_seqlens=documents)
    return positions.tolist(), torch.isfinite(out[:, 0]).all(-1).tolist()


RANK_CASES = [("laga", "sdpa", True, None, "allgather"),
              ("laga", "eager", True, RANK_DOCS, "allgather"),
              ("laga+blockwise", "eager", True, None, "ulysses"),
              ("laga+blockwise", "eager", True, RANK_DOCS, "allgather"),
              ("laga+trim", "sdpa", True, RANK_DOCS, "allgather"),
              ("explicit", "sdpa", True, None, "allgather"),
              ("explicit", "eager", False, RANK_DOCS, "ulysses"),
              ("absorbed", "sdpa", True, None, "ulysses")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant, kernel, causal, documents, cp_algo", RANK_CASES)
def test_on_two_ranks_too(variant, kernel, causal, documents, cp_algo):
    want = expected_finite(9, causal, documents)
    for positions, finite in run_on_ranks(_ranks_worker, 2, variant, kernel, causal, documents,
                                          cp_algo, timeout_s=120):
        assert finite == [want[p] for p in positions], (positions, finite)

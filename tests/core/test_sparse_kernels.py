"""Sparse MLA's stage kernels (mindspeed_laga/sparse/): every registered one equals the math.

The stand-ins of tests/support/fake_dsa_ops.py run as torch_npu, in float64, at the ops'
dims (tests/support/sparse_kernels.py). At CP 1, 2 and 4, contiguous and zigzag, every
combination of the registered stage kernels (``sparse.registry.SPARSE_KERNELS``) gives
the output, the picks, the indexer loss and every grad of the single-process float64
reference (an indexer whose scores are rounded into a loss that reads them, the npu
indexer's bfloat16 into the torch loss: loss and index grads as close as bfloat16
allows), and the byte counter still sees one gather and one reduce-scatter. Every
indexer picks exactly what the torch indexer picks on the same bfloat16 inputs, per chunk
against the key prefix. With ``loss_tp_group`` (two ranks holding four heads each) the
loss and its grads are the all-heads ones for every loss kernel.
"""
import itertools
import re
import sys

import pytest
import torch

from mindspeed_laga.sparse import registry as sparse_registry
from mindspeed_laga import agreement
from mindspeed_laga.sparse.form import sparse_laga_attention
from mindspeed_laga.sparse.stage import Chunk, SparseCall
from mindspeed_laga.tools.spawn import run_on_ranks
from support import fake_dsa_ops, fake_torch_npu
from support import sparse_kernels as sk
from support import sparse_mla as sm

# the attention (and the fused loss's recomputation of it) in float64; the indexer's
# products, the loss and the fused loss's softmax statistics in float32
ATOL = {"index_query": 1e-6, "index_key": 1e-6, "index_weights": 1e-6}
LOSS_RTOL = 1e-6
ROUNDED_RTOL = 2e-2  # bfloat16 scores
INDEX = ("index_query", "index_key", "index_weights")


@pytest.fixture(scope="module")
def references():
    """By loss kernel, with the epsilon it declares: the torch loss adds 1e-8 to both
    distributions (the DSA reference's KL); the fused op computes the exact KL."""
    eps = {name: sparse_registry.sparse_kernel(name).kl_eps
           for name in sparse_registry.SPARSE_KERNELS}
    return {name: sm.reference(sk.inputs(), sk.TOPK, eps=e) for name, e in eps.items()}


@pytest.fixture(scope="module", params=[(1, "contiguous"), (2, "contiguous"), (2, "zigzag"),
                                        (4, "contiguous"), (4, "zigzag")],
                ids=lambda p: f"cp{p[0]}-{p[1]}")
def measured(request):
    cp_size, layout = request.param
    per_rank = run_on_ranks(sk.worker, cp_size, layout, sk.EXACT + sk.ROUNDED, timeout_s=120)
    return cp_size, layout, per_rank


def _close(name, got, want, atol=None):
    scale = want.abs().max().item()
    assert scale > 0, f"{name}: the reference is all zero"
    err = (got - want).abs().max().item()
    assert err <= (atol or ATOL.get(name, 1e-10)) * max(1.0, scale), (name, err, scale)


def _assembled(per_rank, combo, layout):
    return sm.assemble([[ranks[combo]] for ranks in per_rank], 0, layout)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("combo", sk.EXACT, ids="-".join)
def test_combination_equals_reference(measured, references, combo):
    _, layout, per_rank = measured
    reference = references[combo[2]]
    got = _assembled(per_rank, combo, layout)
    assert torch.equal(got["topk_indices"], reference["topk_indices"]), combo
    _close("output", got["output"], reference["output"])
    want_loss = reference["loss"].item()
    assert abs(got["loss"].item() - want_loss) <= LOSS_RTOL * abs(want_loss), combo
    for name, grad in reference["grads"].items():
        _close(name, got["grads"][name], grad)


@pytest.mark.timeout(200)
def test_rounded_index_scores_into_a_loss_that_reads_them(measured, references):
    """The scores the loss reads are bfloat16 there: the attention exact, the loss and the
    index grads to bfloat16's precision."""
    _, layout, per_rank = measured
    assert sk.ROUNDED, "no registered indexer rounds its scores into a loss reading them"
    for combo in sk.ROUNDED:
        reference = references[combo[2]]
        got = _assembled(per_rank, combo, layout)
        assert torch.equal(got["topk_indices"], reference["topk_indices"])
        for name, grad in reference["grads"].items():
            _close(name, got["grads"][name], grad, ROUNDED_RTOL if name in INDEX else None)
        want_loss = reference["loss"].item()
        assert abs(got["loss"].item() - want_loss) <= ROUNDED_RTOL * abs(want_loss)


@pytest.mark.timeout(200)
def test_one_gather_one_reduce_scatter(measured):
    cp_size, _, per_rank = measured
    d = sk.DIMS
    width = (d["D_C"] + d["D_R"] + d["INDEX_DIM"]) * d["S"] // cp_size * d["B"] * 8
    expected = [("handshake", "forward", len(agreement.FIELDS) * 8),  # the ranks' agreement
                ("all_gather", "forward", width), ("reduce_scatter", "backward", width)]
    for ranks in per_rank:
        for combo, run in ranks.items():
            assert run["records"] == (expected if cp_size > 1 else []), (combo, run["records"])


# CP 4 zigzag rank 1 (two chunks) and CP 2 contiguous rank 1: the rows and their chunks
CHUNKED = {"zigzag": [Chunk(0, 4, 8), Chunk(4, 4, 28)], "contiguous": [Chunk(0, 16, 32)]}


@pytest.mark.parametrize("layout", CHUNKED)
def test_every_indexer_picks_the_torch_indexers_keys(layout):
    """Per chunk against the gathered key prefix, the bfloat16 inputs of both sides; an
    indexer rounding its scores (npu: bfloat16) to bfloat16's precision."""
    x = sk.inputs()
    chunks = CHUNKED[layout]
    rows = torch.cat([torch.arange(c.key_end - c.length, c.key_end) for c in chunks])
    results = {}
    fake_torch_npu.install()
    try:
        for kernel in ("torch",) + sparse_registry.SPARSE_KERNELS:
            q, w = (x[n][rows].clone().requires_grad_() for n in ("index_query", "index_weights"))
            k = x["index_key"].clone().requires_grad_()
            call = SparseCall(x["kv_latent"], x["k_pos_emb"], k, rows, chunks, sm.SCALE, 16, 16)
            with fake_dsa_ops.wide_dtypes():
                picks = sparse_registry.sparse_kernel(kernel).topk(call, q, w, sk.TOPK)
            weighted = picks.scores.double().nan_to_num(0.0, 0.0, 0.0) * torch.arange(1.0, sk.TOPK + 1)
            weighted.sum().backward()  # a different weight per slot: the order counts
            results[kernel] = (picks, q.grad, k.grad, w.grad)
    finally:
        fake_torch_npu.uninstall()
    want, *want_grads = results["torch"]
    assert bool((want.indices == -1).any()) == (layout == "zigzag")
    finite = want.indices >= 0
    for kernel in sparse_registry.SPARSE_KERNELS:
        got, *got_grads = results[kernel]
        rounds = sparse_registry.sparse_kernel(kernel).rounds_index_scores
        assert torch.equal(got.indices, want.indices), kernel
        assert torch.equal(torch.isfinite(got.scores), finite), kernel
        torch.testing.assert_close(got.scores[finite].double(), want.scores[finite].double(),
                                   rtol=1e-2 if rounds else 1e-6, atol=0)  # bfloat16 / float32
        for g, w in zip(got_grads, want_grads):
            _close("scores' grad", g, w, 2e-2 if rounds else 1e-6)


@pytest.mark.timeout(200)
def test_loss_tp_group_sums_every_heads_attention(references):
    """Two ranks, four heads each: the loss and the index grads of every rank are the
    all-heads ones; the head-split outputs and grads assemble to the all-heads ones."""
    combos = [("torch", attention, loss) for attention, loss
              in itertools.product(sparse_registry.SPARSE_KERNELS, repeat=2)]
    per_rank = run_on_ranks(sk.tp_worker, 2, combos, timeout_s=120)
    half = sk.DIMS["HEADS"] // 2
    for combo in combos:
        reference = references[combo[2]]
        runs = [ranks[combo] for ranks in per_rank]
        output = torch.cat([r["output"].view(*r["output"].shape[:2], half, -1) for r in runs], dim=2)
        _close("output", output.flatten(2), reference["output"])
        query = torch.cat([r["grads"]["query"] for r in runs], dim=2)
        _close("query", query, reference["grads"]["query"])
        weight = torch.cat([r["grads"]["kv_up_weight"].view(half, -1, sk.DIMS["D_C"]) for r in runs])
        _close("kv_up_weight", weight.flatten(0, 1), reference["grads"]["kv_up_weight"])
        for name in ("kv_latent", "k_pos_emb"):
            _close(name, sum(r["grads"][name] for r in runs), reference["grads"][name])
        for run in runs:
            want_loss = reference["loss"].item()
            assert abs(run["loss"].item() - want_loss) <= LOSS_RTOL * abs(want_loss), combo
            for name in INDEX:
                _close(name, run["grads"][name], reference["grads"][name])


def test_errors_name_the_argument(monkeypatch):
    x = sk.inputs()
    args = [x[k][:4] for k in sm.LOCAL[:3]] + [x["kv_up_weight"]] + [x[k][:4] for k in sm.LOCAL[3:]]
    kw = dict(index_topk=3, softmax_scale=sm.SCALE, qk_head_dim=16, v_head_dim=16,
              indexer_loss_coeff=1.0)
    for argument in sk.STAGES:
        choices = re.escape(str(sparse_registry.SPARSE_KERNELS))
        with pytest.raises(ValueError, match=rf"{argument}='fused' is unknown; use one of {choices}"):
            sparse_laga_attention(*args, **kw, **{argument: "fused"})
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # not installed
    with pytest.raises(ValueError, match="attention_kernel='npu' needs torch_npu"):
        sparse_laga_attention(*args, **kw, attention_kernel="npu")
    fake_torch_npu.install()
    try:
        narrow = list(args)
        narrow[5], narrow[4] = narrow[5][..., :64], narrow[4][..., :64]  # index dim 64
        with pytest.raises(ValueError, match=r"indexer_kernel='npu'.*index_key's last dim in \(128"):
            sparse_laga_attention(*narrow, **kw, indexer_kernel="npu")
        with pytest.raises(ValueError, match=r"indexer_kernel='npu'.*index_topk in range\(1, 2049"):
            sparse_laga_attention(*args, **{**kw, "index_topk": 4096}, indexer_kernel="npu")
        few = list(args)
        few[0] = few[0][:, :, :4]  # four heads: the fused loss takes 8 or more
        few[3] = few[3][:4 * 32]
        with pytest.raises(ValueError, match=r"loss_kernel='npu'.*loss heads in \(8, 16"):
            sparse_laga_attention(*few, **kw, loss_kernel="npu")
        # no loss: the loss kernel is not run, so not checked
        sparse_laga_attention(*narrow, **{**kw, "indexer_loss_coeff": None}, loss_kernel="npu")
    finally:
        fake_torch_npu.uninstall()

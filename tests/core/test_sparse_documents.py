"""Sparse MLA (DSA) with packed documents (``cu_seqlens``): equal to the float64 reference.

A query's top-k, its attention and its loss's target read only its own document's keys
(causal inside it). At CP 1, 2 and 4, in both layouts, on the torch stages and on the
fused ops' stand-ins (every stage "npu"), the output, the picks, the indexer loss and
every grad equal tests/support/sparse_mla.py's reference with the same documents; the
boundaries fall inside the layouts' chunks, so every rank's chunks are cut. Still one
gather forward and one reduce-scatter backward.
"""
import pytest
import torch

from mindspeed_laga.tools.spawn import run_on_ranks
from support import fake_dsa_ops, fake_torch_npu
from support import sparse_kernels as sk
from support import sparse_mla as sm

# S = 16: boundaries 3 and 9 cut zigzag's chunks of 2 (CP 4) and 4 (CP 2) and the
# contiguous 4s and 8s; a document of 3 keys < TOPK leaves -1 picks inside it
DOCUMENTS = (0, 3, 9, 16)
DIMS = {"B": 1}
# the fused ops' dims (sparse_kernels.py), one sequence; boundaries inside the chunks
FUSED_DOCUMENTS = (0, 5, 19, 32)
FUSED_DIMS = dict(sk.DIMS, B=1)
ATOL = {"index_query": 1e-6, "index_key": 1e-6, "index_weights": 1e-6}
LAYOUTS = [(1, "contiguous"), (2, "contiguous"), (2, "zigzag"), (4, "contiguous"),
           (4, "zigzag")]


def _close(name, got, want):
    scale = want.abs().max().item()
    assert scale > 0, f"{name}: the reference is all zero"
    err = (got - want).abs().max().item()
    assert err <= ATOL.get(name, 1e-10) * max(1.0, scale), (name, err, scale)


def _check(per_rank, layout, want):
    got = sm.assemble(per_rank, 0, layout)
    assert torch.equal(got["topk_indices"], want["topk_indices"])
    _close("output", got["output"], want["output"])
    assert abs(got["loss"].item() - want["loss"].item()) <= 1e-6 * abs(want["loss"].item())
    for name, grad in want["grads"].items():
        _close(name, got["grads"][name], grad)
    for records in (r[0]["records"] for r in per_rank):
        data = [(kind, direction) for kind, direction, _ in records if kind != "handshake"]
        assert data == ([] if len(per_rank) == 1 else
                        [("all_gather", "forward"), ("reduce_scatter", "backward")]), data


@pytest.fixture(scope="module")
def reference():
    return sm.reference(sm.full_inputs(0, dims=DIMS), documents=DOCUMENTS)


def test_documents_change_the_result(reference):
    """The documents matter here: without them the picks cross the boundaries."""
    plain = sm.reference(sm.full_inputs(0, dims=DIMS))
    assert not torch.equal(plain["topk_indices"], reference["topk_indices"])
    starts = sm.document_starts(16, DOCUMENTS)
    picks = reference["topk_indices"][0]
    assert all(starts[i] <= j <= i for i in range(16) for j in picks[i].tolist() if j >= 0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cp_size,layout", LAYOUTS, ids=lambda v: str(v))
def test_torch_stages_equal_reference(reference, cp_size, layout):
    per_rank = run_on_ranks(sm.worker, cp_size, layout, [(0, False)], sm.TOPK, DIMS, None,
                            False, None, DOCUMENTS, timeout_s=100)
    _check(per_rank, layout, reference)


def fused_worker(rank, world_size, layout):
    """sm.worker on the fused ops' stand-ins, every stage "npu", with the documents."""
    fake_torch_npu.install()
    with fake_dsa_ops.wide_dtypes():
        return sm.worker(rank, world_size, layout, [(sk.SEED, False)], sk.TOPK, FUSED_DIMS,
                         sk.kernels(("npu",) * 3), True, sk.SCALES, FUSED_DOCUMENTS)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("cp_size,layout", [(1, "contiguous"), (2, "zigzag"), (4, "contiguous"),
                                            (4, "zigzag")], ids=lambda v: str(v))
def test_fused_stages_equal_reference(cp_size, layout):
    x = sm.full_inputs(sk.SEED, dims=FUSED_DIMS, index_bf16=True, scales=sk.SCALES)
    want = sm.reference(x, sk.TOPK, eps=0, documents=FUSED_DOCUMENTS)  # the fused loss: exact KL
    _check(run_on_ranks(fused_worker, cp_size, layout, timeout_s=180), layout, want)


def disagreeing_worker(rank, world_size, documents):
    """One call with this rank's ``documents[rank]``: (the ValueError's message, bytes the
    data collectives moved)."""
    import torch.distributed as dist

    from mindspeed_laga import count_bytes, layout as layouts
    from mindspeed_laga.sparse.form import sparse_laga_attention

    x = sm.full_inputs(0, dims=DIMS)
    local = {k: layouts.shard(x[k], "contiguous", world_size, rank) for k in sm.LOCAL}
    with count_bytes() as counter:
        try:
            sparse_laga_attention(*(local[k] for k in sm.LOCAL[:3]), x["kv_up_weight"],
                                  *(local[k] for k in sm.LOCAL[3:]), index_topk=sm.TOPK,
                                  softmax_scale=sm.SCALE, qk_head_dim=sm.D_N, v_head_dim=sm.D_V,
                                  cp_group=dist.group.WORLD, layout="contiguous",
                                  cu_seqlens=documents[rank])
            return None, counter.bytes()
        except ValueError as exc:
            return str(exc), counter.bytes()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("documents,needle", [
    ([DOCUMENTS, (0, 4, 9, 16)], "documents (cu_seqlens)"),
    ([DOCUMENTS, (0, 9, 3, 16)], "cu_seqlens must increase strictly"),
], ids=["different", "one-rank-invalid"])
def test_documents_that_differ_raise_on_every_rank_before_the_gather(documents, needle):
    results = run_on_ranks(disagreeing_worker, 2, documents, timeout_s=100)
    for rank, (error, moved) in enumerate(results):
        assert error and (needle in error or "rejected their arguments" in error), results
        assert moved == 0, results
    assert any(needle in error for error, _ in results), results


def test_all_keys_target_with_documents_is_refused_by_name():
    x = sm.full_inputs(0, dims=DIMS)
    from mindspeed_laga.sparse.form import sparse_laga_attention
    with pytest.raises(ValueError, match="loss_target='all_keys' with cu_seqlens"):
        sparse_laga_attention(*(x[k] for k in sm.LOCAL[:3]), x["kv_up_weight"],
                              *(x[k] for k in sm.LOCAL[3:]), index_topk=sm.TOPK,
                              softmax_scale=sm.SCALE, qk_head_dim=sm.D_N, v_head_dim=sm.D_V,
                              indexer_loss_coeff=sm.COEFF, loss_target="all_keys",
                              cu_seqlens=DOCUMENTS)

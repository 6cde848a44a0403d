"""Sparse MLA's torch path keeps nothing of size S_local x S from forward to backward.

Every tensor autograd saves during a whole call (torch kernel on every stage, the indexer
loss on, both targets) is recorded through ``torch.autograd.graph.saved_tensors_hooks``:
none may keep s * S elements or more alive, its storage counted (at dims where every legitimate saved tensor, the
gathered keys, the picked latents ``[b, s, k, d_c]``, the inputs, is smaller). Autograd
through ``index_scores``/``top_k`` fails it: it keeps the relu logits ``[b, H, s, S]``,
the causal mask ``[s, S]`` and the ``[b, s, S]`` sort result behind the picks.

The indexer's top-k with its own backward (``sparse/topk_scores.py``) gives the picks and
scores of autograd through ``index_scores``/``top_k`` bit for bit, and their grads to the
float32 products' rounding, in float64 and bfloat16, with future picks (-1) and with a
zigzag rank's two chunks of query positions.
"""
import pytest
import torch

from mindspeed_laga.sparse import indexer
from mindspeed_laga.sparse.form import sparse_laga_attention
from mindspeed_laga.sparse.topk_scores import indexer_topk
from support import sparse_mla as sm

S = 128  # s * S = 16,384 elements, above every legitimate saved tensor at sm's small dims


@pytest.mark.parametrize("loss_target", ["picks", "all_keys"])
def test_nothing_of_s_by_S_is_saved_for_backward(loss_target):
    x = sm.full_inputs(0, dims={"S": S})
    saved = []

    def pack(tensor):  # the elements it keeps alive: a view keeps its whole storage
        kept = tensor.untyped_storage().nbytes() // tensor.element_size()
        saved.append((tuple(tensor.shape), max(tensor.numel(), kept)))
        return tensor

    local = {k: x[k].clone().requires_grad_() for k in sm.NAMES}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = sparse_laga_attention(
            *(local[k] for k in sm.LOCAL[:3]), local["kv_up_weight"],
            *(local[k] for k in sm.LOCAL[3:]), index_topk=sm.TOPK, softmax_scale=sm.SCALE,
            qk_head_dim=sm.D_N, v_head_dim=sm.D_V, layout="contiguous",
            indexer_loss_coeff=sm.COEFF, loss_target=loss_target)
    ((got.output * x["grad_out"]).sum() + got.indexer_loss).backward()
    assert saved, "the hooks saw nothing"
    square = [shape for shape, kept in saved if kept >= S * S]
    assert not square, f"saved for backward with s x S = {S} x {S} elements or more: {square}"
    assert all(local[k].grad is not None for k in ("index_query", "index_key", "index_weights"))


def _autograd_topk(q, k, w, query_pos, topk):
    key_pos = torch.arange(k.shape[0])
    return indexer.top_k(indexer.index_scores(q, k, w, query_pos, key_pos), topk, query_pos)


# (query positions, keys S): a contiguous rank holding the start of the sequence (future
# picks -1), a zigzag rank's two chunks
POSITIONS = {"contiguous": (torch.arange(0, 12), 24),
             "zigzag": (torch.cat([torch.arange(6, 12), torch.arange(36, 42)]), 48)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("layout", POSITIONS)
def test_indexer_topk_equals_autograd_through_the_scores(layout, dtype):
    query_pos, total = POSITIONS[layout]
    s, b, heads, dim, topk = len(query_pos), 2, 4, 8, 10
    g = torch.Generator().manual_seed(1)
    base = {"q": torch.randn(s, b, heads, dim, generator=g, dtype=torch.float64),
            "k": torch.randn(total, b, dim, generator=g, dtype=torch.float64),
            "w": torch.randn(s, b, heads, generator=g, dtype=torch.float64)}
    grad_out = torch.randn(b, s, topk, generator=g, dtype=torch.float64)
    runs = []
    for fn in (_autograd_topk, indexer_topk):
        leaves = {n: t.to(dtype).requires_grad_() for n, t in base.items()}
        picks = fn(leaves["q"], leaves["k"], leaves["w"], query_pos, topk)
        finite = torch.isfinite(picks.scores)
        weighted = torch.where(finite, picks.scores, 0) * grad_out.to(picks.scores.dtype)
        weighted.sum().backward()
        runs.append((picks, {n: t.grad for n, t in leaves.items()}))
    (want, want_grads), (got, got_grads) = runs
    assert (want.indices == -1).any()  # rows with fewer keys than picks
    assert torch.equal(got.indices, want.indices)
    assert got.scores.dtype == want.scores.dtype and torch.equal(got.scores, want.scores)
    for name, grad in want_grads.items():
        assert grad.abs().max() > 0, name
        rtol = 1e-5 if dtype == torch.float64 else 2e-2  # float32 products; bfloat16 grads
        torch.testing.assert_close(got_grads[name], grad, rtol=rtol,
                                   atol=rtol * grad.abs().max().item())

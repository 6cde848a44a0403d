"""``laga_attention(kv_up_linear=...)``: the rebuild calls the given up-projection where it
would call F.linear, with the rows of this rank's heads and where they start; options that
use the weight as a matrix refuse it by name."""
import pytest
import torch
import torch.nn.functional as F

from mindspeed_laga import laga_attention
from mindspeed_laga.tools.spawn import run_on_ranks

HEADS, QK, V, ROPE, LATENT, SEQ = 4, 8, 6, 4, 12, 16


def _inputs(seq=SEQ):
    g = torch.Generator().manual_seed(7)
    return (torch.randn(seq, 2, HEADS, QK + ROPE, generator=g),
            torch.randn(seq, 2, LATENT, generator=g), torch.randn(seq, 2, ROPE, generator=g),
            torch.randn(HEADS * (QK + V), LATENT, generator=g))


def _call(tensors, **kw):
    return laga_attention(*tensors, softmax_scale=0.3, qk_head_dim=QK, v_head_dim=V,
                          kernel="eager", **kw)


def ulysses_worker(rank, world_size):
    query, latent, k_pe, weight = (t.chunk(world_size)[rank] if t.dim() == 3 or t.dim() == 4 else t
                                   for t in _inputs())
    seen = []

    def linear(x, rows, first_row):
        seen.append((first_row, rows.shape[0]))
        assert torch.equal(rows, weight[first_row:first_row + rows.shape[0]])
        return F.linear(x, rows)

    group = torch.distributed.group.WORLD
    kw = dict(cp_group=group, cp_algo="ulysses", layout="contiguous")
    return seen, torch.equal(_call((query, latent, k_pe, weight), kv_up_linear=linear, **kw),
                             _call((query, latent, k_pe, weight), **kw))


def test_ulysses_passes_each_ranks_rows_and_where_they_start():
    per_rank = run_on_ranks(ulysses_worker, 2, timeout_s=120)
    rows = (HEADS // 2) * (QK + V)
    assert [seen for seen, _ in per_rank] == [[(0, rows)], [(rows, rows)]]
    assert all(same for _, same in per_rank)


def test_cp1_calls_it_with_every_row_and_its_gradient_flows():
    tensors = [t.requires_grad_() for t in _inputs()]
    doubled = _call(tensors, kv_up_linear=lambda x, rows, first: F.linear(x, 2 * rows))
    plain = _call(tensors[:3] + [2 * tensors[3]])
    assert torch.equal(doubled, plain)
    (grad,) = torch.autograd.grad(doubled.sum(), tensors[3])
    (want,) = torch.autograd.grad(plain.sum(), tensors[3])
    assert torch.equal(grad, want)


@pytest.mark.parametrize("extra,needle", [
    (dict(kv_up_linear=3), "kv_up_linear must be a function"),
    (dict(kv_up_linear=F.linear, recompute_kv=True), "recompute_kv"),
    (dict(kv_up_linear=F.linear, key_padding_mask=torch.zeros(2, SEQ, dtype=torch.bool)),
     "empty_rows='mean'"),
])
def test_refusals_name_the_option(extra, needle):
    with pytest.raises(ValueError, match=needle):
        _call(_inputs(), **extra)

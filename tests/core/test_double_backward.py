"""Double backward (``create_graph=True``, e.g. a gradient penalty): every form, kernel and
LAGA option either gives the exact second-order grads or raises one clear error when the
grads are differentiated again; never a silent wrong or missing grad.

The expected values come from torch.autograd on a float64 plain softmax attention of the
full sequence written here, independent of the forms. The penalty is
``sum_i <dL/dx_i, v_i>`` of ``L = <out, c>`` with fixed random ``c``, ``v_i``; its grads
are the Hessian-vector products of every input.
"""
from __future__ import annotations

import pytest
import torch

from mindspeed_laga import laga_attention
from mindspeed_laga import layout as layouts
from mindspeed_laga import start_latent_gather
from mindspeed_laga.tools.spawn import run_on_ranks
from support.variants import attention_variants

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

S, B, N, D_N, D_R, D_V, D_C = 16, 1, 4, 8, 4, 8, 16
SCALE = (D_N + D_R) ** -0.5
ONCE = "supports one backward, not double backward"
VARIANTS = attention_variants(kv_block_size=5)
# the paths that must give exact second-order grads (the rest: exact or the clear error)
TWICE = {("laga", "eager"), ("laga+trim", "eager"), ("explicit", "eager"),
         ("absorbed", "eager")}


def tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(S, B, N, D_N + D_R, generator=g, dtype=torch.float64),
            torch.randn(S, B, D_C, generator=g, dtype=torch.float64),
            torch.randn(S, B, D_R, generator=g, dtype=torch.float64),
            torch.randn(N * (D_N + D_V), D_C, generator=g, dtype=torch.float64) * D_C ** -0.5]


def directions():
    """c (the output's cotangent) and v_i (one per input)."""
    c = tensors(1)[0][..., :D_V].reshape(S, B, N * D_V)
    return c, tensors(2)


def reference(query, kv_latent, k_pos_emb, kv_up_weight):
    w = kv_up_weight.view(N, D_N + D_V, D_C)
    k_nope = torch.einsum("sbc,ndc->sbnd", kv_latent, w[:, :D_N])
    value = torch.einsum("sbc,nvc->sbnv", kv_latent, w[:, D_N:])
    key = torch.cat([k_nope, k_pos_emb[:, :, None].expand(S, B, N, D_R)], dim=-1)
    scores = torch.einsum("qbnd,kbnd->bnqk", query, key) * SCALE
    future = torch.ones(S, S, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("bnqk,kbnv->qbnv", probs, value).reshape(S, B, N * D_V)


def penalty_grads(fn, inputs, c, vs):
    """Grads of sum_i <dL/dx_i, v_i>, L = <fn(inputs), c>."""
    out = fn(*inputs)
    first = torch.autograd.grad((out * c).sum(), inputs, create_graph=True)
    penalty = sum((g * v).sum() for g, v in zip(first, vs))
    return torch.autograd.grad(penalty, inputs)


def expected():
    c, vs = directions()
    return penalty_grads(reference, [t.requires_grad_() for t in tensors()], c, vs)


def _close(got, want):
    return all(torch.allclose(a, b, rtol=1e-9, atol=1e-11) for a, b in zip(got, want))


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_second_order_grads_are_exact_or_refused(variant, kernel):
    fn, options = VARIANTS[variant]
    c, vs = directions()
    call = lambda *x: fn(*x, softmax_scale=SCALE, kernel=kernel, **options)  # noqa: E731
    try:
        got = penalty_grads(call, [t.requires_grad_() for t in tensors()], c, vs)
    except RuntimeError as exc:
        assert (variant, kernel) not in TWICE, exc
        assert ONCE in str(exc), exc
        return
    assert _close(got, expected()), (variant, kernel)


# ---------------------------------------------------------------- two ranks

RANK_CASES = {  # name -> (variant, cp_algo, overlapped gather)
    "laga/allgather": ("laga", "allgather", False),
    "laga/ulysses": ("laga", "ulysses", False),
    "explicit/allgather": ("explicit", "allgather", False),
    "explicit/ulysses": ("explicit", "ulysses", False),
    "absorbed/allgather": ("absorbed", "allgather", False),
    "absorbed/ulysses": ("absorbed", "ulysses", False),
    "laga+recompute/allgather": ("laga+recompute", "allgather", False),
    "laga/overlap": ("laga", "allgather", True),
}
REFUSED = ("laga+recompute/allgather", "laga/overlap")


def _one_case(rank, world, variant, cp_algo, overlap):
    import torch.distributed as dist
    fn, options = VARIANTS[variant]
    full = tensors()
    local = [layouts.shard(t, "zigzag", world, rank).requires_grad_() for t in full[:3]]
    local.append(full[3].clone().requires_grad_())
    c, vs = directions()
    c = layouts.shard(c, "zigzag", world, rank)
    vs = [layouts.shard(v, "zigzag", world, rank) for v in vs[:3]] + [vs[3]]

    def call(q, kv, kpe, w):
        extra = dict(options)
        if overlap:
            extra["latent_gather"] = start_latent_gather(kv, kpe, cp_group=dist.group.WORLD)
        return fn(q, kv, kpe, w, softmax_scale=SCALE, kernel="eager", cp_group=dist.group.WORLD,
                  cp_algo=cp_algo, **extra)
    try:
        return penalty_grads(call, local, c, vs)
    except RuntimeError as exc:
        return str(exc)


def _heads(t, rank, world, per_head=1):
    """This TP rank's heads of ``t`` (dim 2 holds the heads), or of a weight's rows."""
    if per_head > 1:  # kv_up_weight: [n*(d_n+d_v), d_c], heads major
        rows = t.view(N, per_head, -1)
        return rows[rank * N // world:(rank + 1) * N // world].reshape(-1, t.shape[-1])
    return t[:, :, rank * N // world:(rank + 1) * N // world]


def _tp_case(rank, world):
    """Tensor parallelism: heads and kv_up_weight's rows split, the latent and the rope key
    whole on every rank and passed through comm.sum_grad; halved directions for those two,
    so the ranks' penalties add up to the single-device one."""
    import torch.distributed as dist
    from mindspeed_laga import comm
    q, kv, kpe, w = tensors()
    local = [_heads(q, rank, world).clone().requires_grad_(), kv.clone().requires_grad_(),
             kpe.clone().requires_grad_(), _heads(w, rank, world, D_N + D_V).clone().requires_grad_()]
    c, vs = directions()
    c = _heads(c.view(S, B, N, D_V), rank, world).reshape(S, B, -1)
    vs = [_heads(vs[0], rank, world), vs[1] / world, vs[2] / world,
          _heads(vs[3], rank, world, D_N + D_V)]

    def call(q, kv, kpe, w):
        kv, kpe = comm.sum_grad(kv, dist.group.WORLD), comm.sum_grad(kpe, dist.group.WORLD)
        return laga_attention(q, kv, kpe, w, softmax_scale=SCALE, kernel="eager")
    out = call(*local)
    first = torch.autograd.grad((out * c).sum(), local)
    return out.detach(), first, penalty_grads(call, local, c, vs)


def _tp_shards(full, rank):
    """This TP rank's part of the single-device (q, kv_latent, k_pos_emb, kv_up_weight)
    values: its heads and weight rows, the latent and the rope key whole."""
    return [_heads(full[0], rank, 2), full[1], full[2], _heads(full[3], rank, 2, D_N + D_V)]


def _rank_worker(rank, world):
    reports = {name: _one_case(rank, world, *case) for name, case in RANK_CASES.items()}
    reports["tp"] = _tp_case(rank, world)
    return reports


@pytest.fixture(scope="module")
def rank_reports():
    return run_on_ranks(_rank_worker, 2, timeout_s=120)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", sorted(RANK_CASES))
def test_second_order_grads_on_two_ranks(rank_reports, name):
    reports = [r[name] for r in rank_reports]
    if name in REFUSED:
        for rank, text in enumerate(reports):
            assert isinstance(text, str) and ONCE in text, (rank, text)
        return
    want = expected()
    for rank, got in enumerate(reports):
        assert not isinstance(got, str), (rank, got)
        for i in range(3):
            shard = layouts.shard(want[i], "zigzag", 2, rank)
            assert torch.allclose(got[i], shard, rtol=1e-9, atol=1e-11), (rank, i)
    total = reports[0][3] + reports[1][3]  # each rank's partial sum of the weight's grad
    assert torch.allclose(total, want[3], rtol=1e-9, atol=1e-11)


@pytest.mark.timeout(200)
def test_second_order_grads_through_tp_sum_grad(rank_reports):
    """comm.sum_grad (the latent's gradient summed over TP): each TP rank's output heads, and
    its first- and second-order grads, equal the single-device reference's."""
    inputs = [t.requires_grad_() for t in tensors()]
    ref_out = reference(*inputs)
    c, _ = directions()
    ref_first = torch.autograd.grad((ref_out * c).sum(), inputs)
    ref_out = ref_out.detach().view(S, B, N, D_V)
    want = expected()
    for rank, report in enumerate(rank_reports):
        out, first, second = report["tp"]
        assert torch.allclose(out, _heads(ref_out, rank, 2).reshape(S, B, -1), rtol=1e-9,
                              atol=1e-11), rank
        for order, got, full in (("first", first, ref_first), ("second", second, want)):
            for i, (a, b) in enumerate(zip(got, _tp_shards(full, rank))):
                assert torch.allclose(a, b, rtol=1e-9, atol=1e-11), (rank, order, i)

"""The torch_npu stand-in against dense references built position by position.

The references here share no code with the stand-in: visibility comes from
per-(query, key) rules written straight from the documented definitions, and
attention runs in float64 with torch.softmax.
"""
from __future__ import annotations

import sys

import pytest
import torch

from support import fake_torch_npu

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

FakeNpuError = fake_torch_npu.FakeNpuError
npu_fusion_attention = fake_torch_npu.npu_fusion_attention
npu_fusion_attention_grad = fake_torch_npu.npu_fusion_attention_grad
COMPRESSED = torch.ones(2048, 2048, dtype=torch.bool).triu(diagonal=1)
SCALE = 0.37


# ------------------------------------------------------------ references

def keep_matrix(sq, skv, rule):
    """[Sq, Skv] bool, True = visible, from a per-(query i, key j) rule."""
    return torch.tensor([[bool(rule(i, j)) for j in range(skv)] for i in range(sq)])


def dense_reference(q, k, v, scale, keep):
    """BNSD float64 attention; query head h reads kv head h // (N1 / N2); all-masked rows -> 0."""
    n1, n2 = q.shape[1], k.shape[1]
    kv_of = torch.arange(n1) // (n1 // n2)
    k, v = k[:, kv_of].double(), v[:, kv_of].double()
    s = torch.matmul(q.double(), k.transpose(-1, -2)) * scale
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    return torch.matmul(p, v), s


def from_bnsd(x, layout):
    """The test's own layout conversion (independent of the stand-in's)."""
    b, n, s, d = x.shape
    if layout == "BNSD":
        return x.contiguous()
    if layout == "BSND":
        return x.permute(0, 2, 1, 3).contiguous()
    if layout == "BSH":
        return x.permute(0, 2, 1, 3).reshape(b, s, n * d)
    return x.permute(2, 0, 1, 3).reshape(s, b, n * d)  # SBH


def to_bnsd(x, layout, heads):
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.permute(0, 2, 1, 3)
    if layout == "BSH":
        b, s, h = x.shape
        return x.reshape(b, s, heads, h // heads).permute(0, 2, 1, 3)
    s, b, h = x.shape
    return x.reshape(s, b, heads, h // heads).permute(1, 2, 0, 3)


def make_qkv(b=2, n1=4, n2=2, sq=5, skv=7, d=8, dv=6, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, n1, sq, d, generator=g).to(dtype),
            torch.randn(b, n2, skv, d, generator=g).to(dtype),
            torch.randn(b, n2, skv, dv, generator=g).to(dtype))


def run_bnsd(q, k, v, **kwargs):
    return npu_fusion_attention(q, k, v, q.shape[1], "BNSD", scale=SCALE, **kwargs)


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)


# ------------------------------------------------------------ forward semantics

@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
def test_layouts_match_dense_reference(layout):
    q, k, v = make_qkv()
    sq, skv = q.shape[2], k.shape[2]
    keep = keep_matrix(sq, skv, lambda i, j: j <= i + skv - sq)
    want, scores = dense_reference(q, k, v, SCALE, keep)
    out, smax, ssum, sout, seed, offset, numels = npu_fusion_attention(
        from_bnsd(q, layout), from_bnsd(k, layout), from_bnsd(v, layout), q.shape[1], layout,
        atten_mask=COMPRESSED, scale=SCALE, sparse_mode=3)
    assert out.shape == from_bnsd(want, layout).shape
    close(to_bnsd(out, layout, q.shape[1]), want)
    row_max = scores.amax(dim=-1, keepdim=True)
    assert smax.shape == ssum.shape == (2, 4, sq, 8) and smax.dtype == ssum.dtype == torch.float32
    close(smax, row_max.expand(-1, -1, -1, 8))
    close(ssum, torch.exp(scores - row_max).sum(dim=-1, keepdim=True).expand(-1, -1, -1, 8))
    assert sout.numel() == 0 and (seed, offset, numels) == (0, 0, 0)


def _mode0_mask(sq, skv, seed=1):
    return torch.rand(sq, skv, generator=torch.Generator().manual_seed(seed)) < 0.3


@pytest.mark.parametrize("sq,skv", [(5, 9), (9, 5), (6, 6)])
@pytest.mark.parametrize("pre,nxt", [(2, 1), (3, -1), (-1, 3), (0, 0), (2147483647, 2147483647)])
def test_mode0_mask_and_pre_next_band(sq, skv, pre, nxt):
    q, k, v = make_qkv(sq=sq, skv=skv)
    mask = _mode0_mask(sq, skv)
    keep = keep_matrix(sq, skv, lambda i, j: not mask[i, j] and i - pre <= j <= i + nxt)
    out = run_bnsd(q, k, v, atten_mask=mask, pre_tockens=pre, next_tockens=nxt, sparse_mode=0)[0]
    close(out, dense_reference(q, k, v, SCALE, keep)[0])


def test_mode0_without_mask_ignores_pre_next():
    q, k, v = make_qkv()
    out = run_bnsd(q, k, v, pre_tockens=1, next_tockens=0, sparse_mode=0)[0]
    close(out, dense_reference(q, k, v, SCALE, None)[0])


@pytest.mark.parametrize("shape", ["SS", "11SS", "B1SS", "BNSS"])
def test_mode1_full_mask_shapes(shape):
    q, k, v = make_qkv()
    (b, n, sq, _), skv = q.shape, k.shape[2]
    dims = {"SS": (sq, skv), "11SS": (1, 1, sq, skv), "B1SS": (b, 1, sq, skv),
            "BNSS": (b, n, sq, skv)}[shape]
    mask = torch.rand(*dims, generator=torch.Generator().manual_seed(3)) < 0.4
    out = run_bnsd(q, k, v, atten_mask=mask.to(torch.uint8), pre_tockens=0, next_tockens=0,
                   sparse_mode=1)[0]
    keep = ~(mask if mask.dim() == 4 else mask.view(1, 1, sq, skv))
    close(out, dense_reference(q, k, v, SCALE, keep)[0])


@pytest.mark.parametrize("sq,skv", [(5, 9), (9, 5), (6, 6)])
@pytest.mark.parametrize("mode", [2, 3])
def test_causal_modes(mode, sq, skv):
    """2: diagonal from the upper-left vertex; 3: from the lower-right vertex."""
    q, k, v = make_qkv(sq=sq, skv=skv)
    shift = 0 if mode == 2 else skv - sq
    keep = keep_matrix(sq, skv, lambda i, j: j <= i + shift)
    out = run_bnsd(q, k, v, atten_mask=COMPRESSED, pre_tockens=1, next_tockens=1,
                   sparse_mode=mode)[0]
    close(out, dense_reference(q, k, v, SCALE, keep)[0])
    if mode == 3 and sq > skv:  # rows before the diagonal enters see nothing: zeros
        assert torch.count_nonzero(out[:, :, :sq - skv]) == 0


@pytest.mark.parametrize("sq,skv", [(5, 9), (9, 5), (6, 6)])
@pytest.mark.parametrize("pre,nxt", [(2, 0), (3, 1), (1, 2)])
def test_mode4_band_from_lower_right(sq, skv, pre, nxt):
    q, k, v = make_qkv(sq=sq, skv=skv)
    shift = skv - sq
    keep = keep_matrix(sq, skv, lambda i, j: i + shift - pre <= j <= i + shift + nxt)
    out = run_bnsd(q, k, v, atten_mask=COMPRESSED, pre_tockens=pre, next_tockens=nxt,
                   sparse_mode=4)[0]
    close(out, dense_reference(q, k, v, SCALE, keep)[0])


@pytest.mark.parametrize("n2", [1, 2, 3, 6])
def test_grouped_heads(n2):
    q, k, v = make_qkv(n1=6, n2=n2, sq=6, skv=6)
    keep = keep_matrix(6, 6, lambda i, j: j <= i)
    out = run_bnsd(q, k, v, atten_mask=COMPRESSED, sparse_mode=3)[0]
    close(out, dense_reference(q, k, v, SCALE, keep)[0])


def test_half_precision_returns_input_dtype_and_float32_stats():
    q, k, v = make_qkv(dtype=torch.bfloat16)
    out, smax, ssum = run_bnsd(q, k, v, atten_mask=COMPRESSED, sparse_mode=3)[:3]
    assert out.dtype == torch.bfloat16 and smax.dtype == ssum.dtype == torch.float32
    keep = keep_matrix(5, 7, lambda i, j: j <= i + 2)
    close(out, dense_reference(q, k, v, SCALE, keep)[0], tol=2e-2)


# ------------------------------------------------------------ rejects

@pytest.mark.parametrize("mode", [2, 3, 4])
@pytest.mark.parametrize("mask", [
    None,
    torch.ones(5, 7, dtype=torch.bool).triu(diagonal=1),            # an uncompressed mask
    torch.ones(2048, 2048, dtype=torch.bool).tril(diagonal=-1),     # wrong triangle
    torch.ones(2048, 2048, dtype=torch.bool).triu(diagonal=2),      # wrong diagonal
    torch.ones(1, 1, 2048, 2048, dtype=torch.bool).triu(diagonal=1),
    torch.ones(2048, 2048).triu(diagonal=1),                        # float
], ids=["none", "full-size", "tril", "diag2", "4d", "float"])
def test_compressed_modes_reject_other_masks(mode, mask):
    q, k, v = make_qkv()
    with pytest.raises(FakeNpuError, match="atten_mask|compressed"):
        run_bnsd(q, k, v, atten_mask=mask, sparse_mode=mode)


def test_compressed_mask_in_uint8_is_accepted():
    q, k, v = make_qkv()
    a = run_bnsd(q, k, v, atten_mask=COMPRESSED.to(torch.uint8), sparse_mode=3)[0]
    close(a, run_bnsd(q, k, v, atten_mask=COMPRESSED, sparse_mode=3)[0], tol=0)


@pytest.mark.parametrize("kwargs,error", [
    (dict(sparse_mode=1), FakeNpuError),                                            # no mask
    (dict(sparse_mode=0, atten_mask=torch.zeros(3, 7, dtype=torch.bool)), FakeNpuError),
    (dict(sparse_mode=0, atten_mask=torch.zeros(5, 7)), FakeNpuError),              # float mask
    (dict(sparse_mode=0, atten_mask=torch.zeros(5, 7, dtype=torch.bool),
          pre_tockens=-2, next_tockens=1), FakeNpuError),                           # empty band
    (dict(sparse_mode=0, atten_mask=torch.zeros(5, 7, dtype=torch.bool),
          pre_tockens=9, next_tockens=-7), FakeNpuError),                           # |next| >= Skv
    (dict(sparse_mode=4, atten_mask=COMPRESSED, pre_tockens=0, next_tockens=-1), FakeNpuError),
    (dict(sparse_mode=9), FakeNpuError),
    (dict(sparse_mode=5), NotImplementedError),
    (dict(keep_prob=0.9), NotImplementedError),
    (dict(pse=torch.zeros(1, 4, 5, 7)), NotImplementedError),
    (dict(actual_seq_qlen=[5]), FakeNpuError),                                     # TND only
])
def test_argument_rejects(kwargs, error):
    q, k, v = make_qkv()
    with pytest.raises(error):
        run_bnsd(q, k, v, **kwargs)


# ------------------------------------------------------------ varlen (TND)

# Per sequence (Sq, Skv); a sequence without queries and two trailing batches that take no part.
SEQS = [(3, 4), (0, 2), (5, 5), (2, 6), (4, 4)]
TRAILING = 2


def tnd_inputs(n1=4, n2=2, d=8, dv=6, seed=3, seqs=SEQS):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(a for a, _ in seqs), sum(b for _, b in seqs)
    return (torch.randn(tq, n1, d, generator=g), torch.randn(tk, n2, d, generator=g),
            torch.randn(tk, n2, dv, generator=g))


def cumulative(lengths, trailing=TRAILING):
    out, total = [], 0
    for n in lengths:
        total += n
        out.append(total)
    return out + [0] * trailing


def tnd_keep(seqs, rule):
    """[Tq, Tkv] bool: query and key in the same sequence and rule(i, j, Sq, Skv) on local indices."""
    rows = []
    for s, (sq, skv) in enumerate(seqs):
        for i in range(sq):
            row = []
            for t, (_, skv2) in enumerate(seqs):
                row += [t == s and bool(rule(i, j, sq, skv)) for j in range(skv2)]
            rows.append(row)
    return torch.tensor(rows)


def bnsd_of(x):
    """The test's own TND [T, N, D] -> [1, N, T, D]."""
    return x.permute(1, 0, 2).unsqueeze(0)


TND_MODES = {
    "mode0_nomask": (dict(sparse_mode=0), lambda i, j, sq, skv: True),
    "mode3_lower_right": (dict(sparse_mode=3, atten_mask=COMPRESSED),
                          lambda i, j, sq, skv: j <= i + skv - sq),
    "mode2_upper_left": (dict(sparse_mode=2, atten_mask=COMPRESSED), lambda i, j, sq, skv: j <= i),
    "mode4_band": (dict(sparse_mode=4, atten_mask=COMPRESSED, pre_tockens=2, next_tockens=0),
                   lambda i, j, sq, skv: i + skv - sq - 2 <= j <= i + skv - sq),
}


def tnd_call(q, k, v, kwargs, seqs=SEQS, fn=npu_fusion_attention, *args, **extra):
    return fn(q, k, v, *args, q.shape[1], "TND", actual_seq_qlen=cumulative([a for a, _ in seqs]),
              actual_seq_kvlen=cumulative([b for _, b in seqs]), **kwargs, **extra)


@pytest.mark.parametrize("mode", sorted(TND_MODES))
def test_tnd_matches_float64_reference_per_sequence(mode):
    kwargs, rule = TND_MODES[mode]
    q, k, v = (x.requires_grad_() for x in tnd_inputs())
    out, smax, ssum = tnd_call(q, k, v, dict(kwargs, scale=SCALE))[:3]
    keep = tnd_keep(SEQS, rule)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want, scores = dense_reference(*(bnsd_of(x) for x in leaves), SCALE, keep)
    want = want[0].permute(1, 0, 2)
    assert out.shape == want.shape and out.dtype == torch.float32
    close(out, want)
    row_max = scores.amax(dim=-1, keepdim=True)
    row_sum = torch.exp(scores - row_max).sum(dim=-1, keepdim=True)
    assert smax.shape == ssum.shape == (q.shape[0], q.shape[1], 8)
    close(smax, row_max[0].permute(1, 0, 2).expand(-1, -1, 8))
    close(ssum, row_sum[0].permute(1, 0, 2).expand(-1, -1, 8))
    # autograd through the stand-in and its grad op both match float64 autograd
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    want_grads = torch.autograd.grad(want, leaves, dy.double())
    got_autograd = torch.autograd.grad(out, (q, k, v), dy)
    grad_kwargs = {name.replace("scale", "scale_value"): x for name, x in kwargs.items()}
    got = tnd_call(q.detach(), k.detach(), v.detach(), grad_kwargs, SEQS, npu_fusion_attention_grad,
                   dy, softmax_max=smax, softmax_sum=ssum, attention_in=out.detach(),
                   scale_value=SCALE)
    assert len(got) == 4 and got[3].numel() == 0
    for g, a, w in zip(got[:3], got_autograd, want_grads):
        assert g.shape == w.shape
        close(g, w)
        close(a, w)


def test_tnd_call_is_recorded_with_its_lengths(monkeypatch):
    module = fake_torch_npu.install()
    try:
        module.reset_calls()
        q, k, v = tnd_inputs()
        tnd_call(q, k, v, dict(sparse_mode=3, atten_mask=COMPRESSED))
        (call,) = module.calls
        assert call["input_layout"] == "TND"
        assert call["actual_seq_qlen"] == cumulative([a for a, _ in SEQS])
        assert call["actual_seq_kvlen"] == cumulative([b for _, b in SEQS])
        assert module.largest_mask_elements == 2048 * 2048
    finally:
        fake_torch_npu.uninstall()


def _tnd_reject(**change):
    q, k, v = tnd_inputs()
    args = dict(actual_seq_qlen=cumulative([a for a, _ in SEQS]),
                actual_seq_kvlen=cumulative([b for _, b in SEQS]), sparse_mode=0)
    args.update(change.pop("kwargs", {}))
    q, k, v = change.pop("tensors", (q, k, v))
    return npu_fusion_attention(q, k, v, q.shape[-2] if q.dim() == 3 else 4, "TND", **args)


TQ, TK = sum(a for a, _ in SEQS), sum(b for _, b in SEQS)


@pytest.mark.parametrize("change,error,match", [
    (dict(kwargs=dict(actual_seq_qlen=None)), FakeNpuError, "actual_seq"),
    (dict(kwargs=dict(actual_seq_kvlen=None)), FakeNpuError, "actual_seq"),
    (dict(kwargs=dict(actual_seq_qlen=[3, 3, 8, 10, TQ - 1])), FakeNpuError, "must end at"),
    (dict(kwargs=dict(actual_seq_kvlen=[4, 6, 11, 17, TK + 1])), FakeNpuError, "must end at"),
    (dict(kwargs=dict(actual_seq_qlen=[3, 2, 8, 10, TQ])), FakeNpuError, "decreases"),
    (dict(kwargs=dict(actual_seq_qlen=[3, 3, 8, 10, TQ, 0])), FakeNpuError, "different batches"),
    (dict(kwargs=dict(actual_seq_qlen=torch.tensor([3, 3, 8, 10, TQ]))), FakeNpuError, "host list"),
    (dict(kwargs=dict(actual_seq_qlen=[0, 0])), FakeNpuError, "must end at"),
    (dict(kwargs=dict(actual_seq_kvlen=[4, 6, 6, 17, 21, 0, 0])), FakeNpuError, "no key"),
    (dict(kwargs=dict(sparse_mode=5, atten_mask=COMPRESSED)), FakeNpuError, "sparse_mode=5"),
    (dict(kwargs=dict(sparse_mode=3, atten_mask=torch.ones(5, 6, dtype=torch.bool).triu(1))),
     FakeNpuError, "compressed"),
    (dict(kwargs=dict(sparse_mode=1, atten_mask=COMPRESSED)), NotImplementedError, "TND"),
    (dict(kwargs=dict(sparse_mode=0, atten_mask=torch.zeros(5, 6, dtype=torch.bool))),
     NotImplementedError, "TND"),
    (dict(tensors=tuple(x.unsqueeze(0) for x in tnd_inputs())), FakeNpuError, "no batch axis"),
    (dict(tensors=tnd_inputs(n1=4, n2=3)), FakeNpuError, "multiple"),
])
def test_tnd_rejects_what_the_op_rejects(change, error, match):
    with pytest.raises(error, match=match):
        _tnd_reject(**change)


def test_tnd_rejects_fully_masked_rows():
    """Mode 3 with more queries than keys in a sequence masks whole rows: varlen refuses."""
    seqs = [(3, 4), (5, 2)]
    q, k, v = tnd_inputs(seqs=seqs)
    with pytest.raises(FakeNpuError, match="fully masked"):
        tnd_call(q, k, v, dict(sparse_mode=3, atten_mask=COMPRESSED), seqs)


def test_tnd_grad_checks_statistics_shape():
    q, k, v = tnd_inputs()
    out, smax, ssum = tnd_call(q, k, v, dict(sparse_mode=0))[:3]
    bad = smax.permute(1, 0, 2)  # [N, T, 8] is not the TND statistics layout
    with pytest.raises(FakeNpuError, match="softmax_max"):
        tnd_call(q, k, v, dict(sparse_mode=0), SEQS, npu_fusion_attention_grad, torch.ones_like(out),
                 softmax_max=bad, softmax_sum=ssum, attention_in=out)


@pytest.mark.parametrize("case", ["qk_dims_differ", "v_dim_above_qk", "kv_seq_differ",
                                  "heads_not_multiple", "head_num_wrong", "bsh_not_divisible",
                                  "float64", "mixed_dtypes", "dim_above_768"])
def test_shape_and_dtype_errors(case):
    q, k, v = make_qkv()
    head_num, layout = 4, "BNSD"
    if case == "qk_dims_differ":
        k = torch.randn(2, 2, 7, 10)
    elif case == "v_dim_above_qk":
        v = torch.randn(2, 2, 7, 10)
    elif case == "kv_seq_differ":
        v = torch.randn(2, 2, 6, 6)
    elif case == "heads_not_multiple":
        k, v = torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 6)
    elif case == "head_num_wrong":
        head_num = 2
    elif case == "bsh_not_divisible":
        q, k, v = (from_bnsd(x, "BSH") for x in (q, k, v))
        head_num, layout = 3, "BSH"
    elif case == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif case == "mixed_dtypes":
        v = v.half()
    elif case == "dim_above_768":
        q, k = torch.randn(2, 4, 5, 769), torch.randn(2, 2, 7, 769)
    with pytest.raises(FakeNpuError):
        npu_fusion_attention(q, k, v, head_num, layout, scale=SCALE)


def test_mla_head_dims_are_accepted_unpadded():
    """qk 192 / v 128 (MLA without padding) and the absorbed 576 / 512 both pass the dim rules."""
    for d, dv, n2 in ((192, 128, 2), (576, 512, 1)):
        q, k, v = make_qkv(n1=2, n2=n2, sq=3, skv=3, d=d, dv=dv)
        out = run_bnsd(q, k, v, atten_mask=COMPRESSED, sparse_mode=3)[0]
        assert out.shape == (2, 2, 3, dv)


# ------------------------------------------------------------ backward

GRAD_CASES = {
    "causal3_grouped": dict(n1=4, n2=2, sq=5, skv=7,
                            kwargs=dict(atten_mask=COMPRESSED, sparse_mode=3)),
    "causal3_invalid_rows": dict(n1=4, n2=1, sq=7, skv=4,
                                 kwargs=dict(atten_mask=COMPRESSED, sparse_mode=3)),
    "band0": dict(n1=2, n2=2, sq=6, skv=6,
                  kwargs=dict(atten_mask=torch.zeros(6, 6, dtype=torch.bool), pre_tockens=2,
                              next_tockens=1, sparse_mode=0)),
    "band4": dict(n1=4, n2=4, sq=4, skv=8, kwargs=dict(atten_mask=COMPRESSED, pre_tockens=3,
                                                       next_tockens=0, sparse_mode=4)),
    "full": dict(n1=3, n2=1, sq=5, skv=6, kwargs=dict()),
}


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
@pytest.mark.parametrize("case", sorted(GRAD_CASES))
def test_grad_function_matches_autograd(case, layout):
    spec = GRAD_CASES[case]
    q, k, v = make_qkv(n1=spec["n1"], n2=spec["n2"], sq=spec["sq"], skv=spec["skv"], seed=7)
    q, k, v = (from_bnsd(x, layout).requires_grad_() for x in (q, k, v))
    out, smax, ssum = npu_fusion_attention(q, k, v, spec["n1"], layout, scale=SCALE,
                                           **spec["kwargs"])[:3]
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(11))
    want = torch.autograd.grad(out, (q, k, v), dy)
    kwargs = {name.replace("scale", "scale_value"): value for name, value in spec["kwargs"].items()}
    got = npu_fusion_attention_grad(q.detach(), k.detach(), v.detach(), dy, spec["n1"], layout,
                                    softmax_max=smax, softmax_sum=ssum,
                                    attention_in=out.detach(), scale_value=SCALE, **kwargs)
    assert len(got) == 4 and got[3].numel() == 0
    for g, w in zip(got[:3], want):
        assert g.shape == w.shape
        close(g, w)


def test_autograd_matches_dense_reference():
    q, k, v = (x.requires_grad_() for x in make_qkv(n1=4, n2=2, sq=5, skv=7, seed=5))
    keep = keep_matrix(5, 7, lambda i, j: j <= i + 2)
    out = run_bnsd(q, k, v, atten_mask=COMPRESSED, sparse_mode=3)[0]
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad(out, (q, k, v), dy)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(dense_reference(*leaves, SCALE, keep)[0], leaves, dy.double())
    for g, w in zip(got, want):
        close(g, w)


def test_grad_needs_forward_statistics():
    q, k, v = make_qkv()
    with pytest.raises(FakeNpuError, match="softmax_max"):
        npu_fusion_attention_grad(q, k, v, torch.zeros(2, 4, 5, 6), 4, "BNSD")


# ------------------------------------------------------------ install / uninstall

def test_install_is_idempotent_and_uninstall_restores(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    first = fake_torch_npu.install()
    assert fake_torch_npu.install() is first and sys.modules["torch_npu"] is first
    import torch_npu  # noqa: F401  (what the code under test does)
    assert torch_npu.npu_fusion_attention is npu_fusion_attention
    fake_torch_npu.uninstall()
    assert "torch_npu" not in sys.modules
    fake_torch_npu.uninstall()  # harmless when nothing is installed

    sentinel = type(sys)("torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", sentinel)
    fake_torch_npu.install()
    assert sys.modules["torch_npu"] is not sentinel
    fake_torch_npu.uninstall()
    assert sys.modules["torch_npu"] is sentinel


def test_calls_are_recorded_only_when_installed(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    module = fake_torch_npu.install()
    try:
        q, k, v = make_qkv()
        module.reset_calls()
        run_bnsd(q, k, v, atten_mask=COMPRESSED, sparse_mode=3)
        (call,) = module.calls
        assert call["sparse_mode"] == 3 and call["atten_mask_shape"] == (2048, 2048)
        assert call["key_shape"] == (2, 2, 7, 8)
    finally:
        fake_torch_npu.uninstall()


# ------------------------------------------------------------ limits of the op, mask record

def test_more_than_256_query_heads_are_rejected():
    q, k, v = make_qkv(n1=257, n2=1, sq=2, skv=3, d=4, dv=4)
    with pytest.raises(FakeNpuError, match="head_num"):
        run_bnsd(q, k, v)
    q, k, v = make_qkv(n1=256, n2=1, sq=2, skv=3, d=4, dv=4)
    assert run_bnsd(q, k, v)[0].shape == (2, 256, 2, 4)


@pytest.mark.parametrize("sq,skv,pre,nxt", [(7, 13, 13, 1), (13, 7, 7, 6), (37, 20, 20, 3),
                                            (5, 37, 37, -2), (13, 13, 4, 0)])
def test_mode4_band_at_odd_offsets(sq, skv, pre, nxt):
    """Mode 4 from the lower-right vertex at sizes and offsets that align with nothing,
    forward and backward against float64 autograd."""
    q, k, v = (x.requires_grad_() for x in make_qkv(n1=2, n2=2, sq=sq, skv=skv, seed=sq + skv))
    shift = skv - sq
    keep = keep_matrix(sq, skv, lambda i, j: i + shift - pre <= j <= i + shift + nxt)
    out, smax, ssum = run_bnsd(q, k, v, atten_mask=COMPRESSED, pre_tockens=pre,
                               next_tockens=nxt, sparse_mode=4)[:3]
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = dense_reference(*leaves, SCALE, keep)[0]
    close(out, want)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    got = npu_fusion_attention_grad(q.detach(), k.detach(), v.detach(), dy, 2, "BNSD",
                                    atten_mask=COMPRESSED, softmax_max=smax, softmax_sum=ssum,
                                    attention_in=out.detach(), scale_value=SCALE,
                                    pre_tockens=pre, next_tockens=nxt, sparse_mode=4)[:3]
    for g, w in zip(got, torch.autograd.grad(want, leaves, dy.double())):
        close(g, w)


def test_largest_mask_is_recorded_and_reset(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    module = fake_torch_npu.install()
    try:
        module.reset_calls()
        q, k, v = make_qkv(sq=5, skv=7)
        assert module.largest_mask_elements == 0
        run_bnsd(q, k, v, atten_mask=torch.zeros(5, 7, dtype=torch.bool), sparse_mode=0)
        assert module.largest_mask_elements == 35
        run_bnsd(q, k, v, atten_mask=COMPRESSED, sparse_mode=3)
        run_bnsd(q, k, v, atten_mask=torch.zeros(2, 1, 5, 7, dtype=torch.bool), sparse_mode=1)
        assert module.largest_mask_elements == 2048 * 2048
        module.reset_calls()
        assert module.largest_mask_elements == 0 and module.calls == []
    finally:
        fake_torch_npu.uninstall()

"""The MX-FP8 stand-in (tests/support/fake_npu_quant.py) against a plain-Python re-derivation
of MX block scaling: every e4m3/e5m2 value enumerated from its bits, the block scale from
``math.frexp``, round half to even by bit pattern, saturation to the largest normal; and
the scaled matmul as a float64 sum of dequantized products. Shapes and dtypes the device
op rejects raise."""
import math

import pytest
import torch

from support import fake_npu_quant as mx

pytestmark = [pytest.mark.ascend,  # also in the Ascend leg (tests/conftest.py)
              pytest.mark.skipif(mx.SCALE_DTYPE is None, reason="torch without float8_e8m0fnu")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E8M0 = mx.SCALE_DTYPE


def _values(exp_bits, man_bits, bias, finite):
    """{bit pattern: value} of every finite non-negative code of a small float format."""
    table = {}
    for code in range(1 << (exp_bits + man_bits)):
        exponent, mantissa = code >> man_bits, code & ((1 << man_bits) - 1)
        if not finite(exponent, mantissa):
            continue
        if exponent == 0:
            value = mantissa / (1 << man_bits) * 2.0 ** (1 - bias)
        else:
            value = (1 + mantissa / (1 << man_bits)) * 2.0 ** (exponent - bias)
        table[code] = value
    return table


FORMATS = {  # dtype: (emax, codes -> value)
    E4M3: (8, _values(4, 3, 7, lambda e, m: not (e == 15 and m == 7))),
    E5M2: (15, _values(5, 2, 15, lambda e, m: e != 31)),
}


def ref_round(value, dtype):
    """Nearest representable value, ties to the even code, saturating at the largest."""
    table = FORMATS[dtype][1]
    magnitude = min(abs(value), max(table.values()))
    best = min(table.items(), key=lambda item: (abs(item[1] - magnitude), item[0] & 1))
    return math.copysign(best[1], value) if value != 0 else 0.0


def ref_block(block, dtype):
    """(the dequantized values, the scale exponent) of one block of <= 32 floats."""
    emax = FORMATS[dtype][0]
    amax = max(abs(v) for v in block)
    exponent = -127 if amax == 0 else max(-127, math.frexp(amax)[1] - 1 - emax)
    return [ref_round(v / 2.0 ** exponent, dtype) for v in block], exponent


def ref_quantize_rows(rows, dtype):
    """Blocks of 32 along each row: (fp8 values per row, exponents per row)."""
    values, exponents = [], []
    for row in rows:
        row_values, row_exps = [], []
        for start in range(0, len(row), 32):
            q, e = ref_block(row[start:start + 32], dtype)
            row_values += q
            row_exps.append(e)
        values.append(row_values)
        exponents.append(row_exps)
    return values, exponents


def _sample(rows, cols, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, cols).view(1, -1)
    x[0, :32] = 0.0  # an all-zero block
    x[1, 0] = 1.9 * 2.0 ** 5  # scaled to 486.4: saturates to 448 in e4m3
    return x.to(dtype)


def _unpacked(scale, blocks, axis):
    exps = mx.scale_exponents(scale)
    if axis == -1:  # [M, pairs, 2] -> [M, blocks]
        return exps.reshape(exps.shape[0], -1)[:, :blocks].tolist()
    # [pairs, K, 2] -> per column: [K, blocks]
    return exps.permute(1, 0, 2).reshape(exps.shape[1], -1)[:, :blocks].tolist()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("axis", [-1, -2])
def test_quantize_matches_reference(dtype, axis):
    x = _sample(6, 70) if axis == -1 else _sample(6, 70).t().contiguous()  # 70: an odd tail
    y, scale = mx.npu_dynamic_mx_quant(x, axis=axis, dst_type=dtype)
    assert y.dtype == dtype and y.shape == x.shape and scale.dtype == E8M0
    lines = x.float().tolist() if axis == -1 else x.float().t().tolist()
    want_values, want_exps = ref_quantize_rows(lines, dtype)
    got = y.float() if axis == -1 else y.float().t()
    assert got.tolist() == want_values
    blocks = math.ceil(70 / 32)
    want_shape = (6, 2, 2) if axis == -1 else (2, 6, 2)
    assert tuple(scale.shape) == want_shape
    assert _unpacked(scale, blocks, axis) == want_exps


def test_known_values():
    block = torch.tensor([[1.0, -3.0, 0.3, 6.5] + [0.0] * 28], dtype=torch.float32)
    y, scale = mx.npu_dynamic_mx_quant(block, axis=-1, dst_type=E4M3)
    # amax 6.5: floor(log2) = 2, exponent 2 - 8 = -6; 0.3 * 64 = 19.2, between the e4m3
    # values 18 and 20 (step 2 in [16, 32)): 20; 6.5 * 64 = 416 (exact)
    assert mx.scale_exponents(scale)[0, 0, 0].item() == -6
    assert y.float()[0, :4].tolist() == [64.0, -192.0, 20.0, 416.0]
    saturating = torch.tensor([[1.9 * 2.0 ** 5] + [1.0] * 31])
    y, _ = mx.npu_dynamic_mx_quant(saturating, axis=-1, dst_type=E4M3)
    assert y.float()[0, 0].item() == 448.0


def test_dual_axis_is_both_single_axes():
    x = _sample(40, 96)
    y1, s1, y2, s2 = mx.npu_dynamic_mx_quant_with_dual_axis(x, dst_type=E4M3)
    for y, s, axis in ((y1, s1, -1), (y2, s2, -2)):
        want_y, want_s = mx.npu_dynamic_mx_quant(x, axis=axis, dst_type=E4M3)
        assert torch.equal(y.float(), want_y.float()) and torch.equal(
            s.view(torch.uint8), want_s.view(torch.uint8))
    assert tuple(s2.shape) == (1, 96, 2)


def _mm_args(m, k, n):
    x = _sample(m, k, seed=1)
    w = _sample(n, k, seed=2)
    xq, xs = mx.npu_dynamic_mx_quant(x, axis=-1, dst_type=E4M3)
    wq, ws = mx.npu_dynamic_mx_quant(w, axis=-1, dst_type=E4M3)
    return xq, wq.t(), ws.transpose(0, 1), xs


def _mm(xq, wq_t, ws_t, xs, **kw):
    args = dict(pertoken_scale=xs, output_dtype=torch.float32, scale_dtype=E8M0,
                pertoken_scale_dtype=E8M0, group_sizes=[1, 1, 32])
    args.update(kw)
    return mx.npu_quant_matmul(xq, wq_t, ws_t, **args)


def test_quant_matmul_matches_reference():
    xq, wq_t, ws_t, xs = _mm_args(5, 70, 9)
    out = _mm(xq, wq_t, ws_t, xs)
    x_exp, w_exp = mx.scale_exponents(xs).reshape(5, -1), mx.scale_exponents(ws_t)
    w_exp = w_exp.permute(1, 0, 2).reshape(9, -1)
    want = [[sum(xq[i, k].item() * 2.0 ** x_exp[i, k // 32].item()
                 * wq_t[k, j].item() * 2.0 ** w_exp[j, k // 32].item() for k in range(70))
             for j in range(9)] for i in range(5)]
    want = torch.tensor(want, dtype=torch.float64)
    assert torch.allclose(out.double(), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    assert _mm(xq, wq_t, ws_t, xs, output_dtype=torch.bfloat16).dtype == torch.bfloat16


def test_strict_arguments():
    xq, wq_t, ws_t, xs = _mm_args(5, 64, 8)
    with pytest.raises(mx.FakeQuantError, match="scale of x2"):
        _mm(xq, wq_t, ws_t[:, :4], xs)
    with pytest.raises(mx.FakeQuantError, match="scale of x1"):
        _mm(xq, wq_t, ws_t, xs[:4])
    with pytest.raises(mx.FakeQuantError, match="do not chain"):
        _mm(xq, wq_t[:32], ws_t, xs)
    with pytest.raises(mx.FakeQuantError, match="float8"):
        _mm(xq.float(), wq_t, ws_t, xs)
    with pytest.raises(mx.FakeQuantError, match="e8m0"):
        _mm(xq, wq_t, ws_t.view(torch.uint8), xs)
    with pytest.raises(NotImplementedError):
        _mm(xq, wq_t, ws_t, xs, group_sizes=[1, 128, 128])
    with pytest.raises(mx.FakeQuantError, match="output_dtype"):
        _mm(xq, wq_t, ws_t, xs, output_dtype=torch.int8)
    x = torch.randn(4, 64)
    with pytest.raises(mx.FakeQuantError, match="float16/bfloat16/float32"):
        mx.npu_dynamic_mx_quant(x.double(), axis=-1, dst_type=E4M3)
    with pytest.raises(mx.FakeQuantError, match="dst_type"):
        mx.npu_dynamic_mx_quant(x, axis=-1, dst_type=torch.int8)
    with pytest.raises(NotImplementedError, match="HiFloat8"):
        mx.npu_dynamic_mx_quant(x, axis=-1, dst_type=mx.hifloat8)
    with pytest.raises(NotImplementedError, match="round_mode"):
        mx.npu_dynamic_mx_quant(x, axis=-1, dst_type=E4M3, round_mode="floor")
    with pytest.raises(mx.FakeQuantError, match="at least 2D"):
        mx.npu_dynamic_mx_quant_with_dual_axis(x[0], dst_type=E4M3)


def test_registered_in_torch_npu_stand_in():
    from support import fake_torch_npu
    module = fake_torch_npu._build()
    assert module.npu_quant_matmul is mx.npu_quant_matmul
    assert module.float8_e8m0fnu is E8M0 and module.hifloat8 is mx.hifloat8


@pytest.mark.parametrize("m,k,n", [(0, 64, 8), (5, 0, 8), (5, 64, 0)])
def test_empty_operands(m, k, n):
    """An MoE expert that gets no token on a rank: empty rows (or an empty contraction)."""
    x, w = torch.randn(m, k), torch.randn(n, k)
    y1, s1, y2, s2 = mx.npu_dynamic_mx_quant_with_dual_axis(x, dst_type=E4M3)
    assert y1.shape == y2.shape == (m, k)
    assert tuple(s1.shape) == (m, math.ceil(math.ceil(k / 32) / 2), 2)
    assert tuple(s2.shape) == (math.ceil(math.ceil(m / 32) / 2), k, 2)
    wq, ws = mx.npu_dynamic_mx_quant(w, axis=-1, dst_type=E4M3)
    out = _mm(y1, wq.t(), ws.transpose(0, 1), s1)
    assert out.shape == (m, n) and not out.any()

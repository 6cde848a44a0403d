"""The fused block kernel (``kernel='sdpa'`` with ``recompute_kv``): one block
against float64 attention with a dense mask, then LAGA's blockwise path on
1 and 2 gloo ranks against the float64 single-device reference (output and
all four grads) for both cp_algos, both layouts, odd block sizes, causal
prefix trimming, causal and non-causal, float32 and bfloat16.

bfloat16 tolerance: the one of test_equivalence (8 bf16 ulps of relative
error); each block's output is rounded to bf16 by the fused op before the
float32 merge, one rounding per block as in any flash kernel's split-K path.
"""
import itertools

import pytest
import torch

from mindspeed_laga.tools import equivalence as eq
from mindspeed_laga.kernels import sdpa as fb
from mindspeed_laga.kernels.merge import merge_lse
from mindspeed_laga.kernels.sdpa import block_calls
from mindspeed_laga.checks import resolve_kernel

from support.references import assert_matches_reference, case_id, cp_matrix
from support.variants import PLAIN_ALGOS


# ------------------------------------------------------------- one block

def _dense_reference(q, key, value, keep, scale, d_out):
    """float64 softmax attention with a dense mask and its grads by autograd."""
    q, key, value = (x.detach().double().requires_grad_() for x in (q, key, value))
    s = (q @ key.transpose(-1, -2)) * scale
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.softmax(s, dim=-1) @ value
    out.backward(d_out.double())
    return out.detach(), lse.detach(), q.grad, key.grad, value.grad


def _staircase(rows, num_keys, offset):
    """Key j visible to row i iff j <= i + offset (the blockwise walk's causal block)."""
    return torch.arange(num_keys).unsqueeze(0) <= torch.arange(rows).unsqueeze(1) + offset


BLOCKS = [(5, 7, None), (5, 7, 0), (5, 7, 2), (3, 9, 4), (4, 4, 3), (6, 3, 0)]
DIMS = [(24, 16), (16, 24), (8, 8)]
BLOCK_TOL = {torch.float64: 1e-6, torch.float32: 1e-5, torch.bfloat16: 8 * 2.0 ** -9}


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"qk{d[0]}-v{d[1]}")
@pytest.mark.parametrize("rows,num_keys,offset", BLOCKS)
def test_block_matches_float64_dense_attention(rows, num_keys, offset, dims, dtype):
    g = torch.Generator().manual_seed(rows * 100 + num_keys)
    d_qk, d_v = dims
    q, key = (torch.randn(2, 3, n, d_qk, generator=g).to(dtype) for n in (rows, num_keys))
    value = torch.randn(2, 3, num_keys, d_v, generator=g).to(dtype)
    d_out = torch.randn(2, 3, rows, d_v, generator=g).to(dtype)
    keep = None if offset is None else _staircase(rows, num_keys, offset)
    ref_out, ref_lse, *ref_grads = _dense_reference(q, key, value, keep, 0.3, d_out)

    out, lse = fb.FusedBlock.forward(q, key, value, offset, 0.3)
    assert out.dtype == lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # backward from the block's own output: the final one when the block is the only one
    grads = fb.FusedBlock.backward(q, key, value, offset, 0.3, d_out, out.to(dtype), lse)
    tol = BLOCK_TOL[dtype]
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-5
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        assert got.shape == want.shape
        assert _rel(got, want) <= tol, name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("one_call", [True, False], ids=["one-masked-call", "two-merged-calls"])
@pytest.mark.parametrize("rows,num_keys", [(5, 7), (3, 9), (2, 8)])
def test_segment_matches_float64_dense_attention_either_way(monkeypatch, rows, num_keys,
                                                             one_call, dtype):
    """A CPU segment that ends at its key prefix's end (bottom-right causal) runs as one
    call with a cached mask when small, else as two calls merged: both are attention."""
    if not one_call:
        monkeypatch.setattr(fb, "MASKED_SCORES", 0)
    offset = num_keys - rows
    assert (fb.small_segment_mask(rows, num_keys, offset, dtype, torch.device("cpu"))
            is not None) == one_call
    g = torch.Generator().manual_seed(rows * 10 + num_keys)
    q, key = (torch.randn(2, 3, n, 24, generator=g).to(dtype).requires_grad_()
              for n in (rows, num_keys))
    value = torch.randn(2, 3, num_keys, 16, generator=g).to(dtype).requires_grad_()
    d_out = torch.randn(2, 3, rows, 16, generator=g).to(dtype)
    ref_out, _, *ref_grads = _dense_reference(q, key, value, _staircase(rows, num_keys, offset),
                                              0.3, d_out)
    out = fb.FusedSegment.apply(q, key, value, 0.3, offset)
    out.backward(d_out)
    tol = BLOCK_TOL[dtype]
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, key.grad, value.grad),
                               (ref_out, *ref_grads)):
        assert got.dtype == dtype and got.shape == want.shape, name
        assert _rel(got, want) <= tol, name


# (rows, lo, hi) per segment over 12 keys: zigzag's two chunks, a trimmed window, one row
WINDOWS = [((4, 0, 4), (4, 0, 12)), ((4, 0, 8), (4, 0, 12)), ((3, 2, 7), (2, 7, 12)),
           ((1, 0, 1), (5, 3, 12))]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("windows", WINDOWS, ids=str)
def test_all_segments_in_one_masked_call_are_attention(windows, dtype):
    """kernel='sdpa' on CPU takes every segment of a small causal call at once
    (``attend_rows``): each segment's rows see their window bottom-right aligned and
    nothing else, against float64 dense attention with that mask (output and grads)."""
    from mindspeed_laga.kernels.nonfinite import Window
    windows = tuple(Window(rows, lo, hi, None) for rows, lo, hi in windows)
    rows, num_keys = sum(w.rows for w in windows), 12
    keep = torch.zeros(rows, num_keys, dtype=torch.bool)
    first = 0
    for n, lo, hi, _ in windows:
        keep[first:first + n, lo:hi] = _staircase(n, hi - lo, hi - lo - n)
        first += n
    g = torch.Generator().manual_seed(rows)
    q, key = (torch.randn(2, 3, n, 24, generator=g).to(dtype).requires_grad_()
              for n in (rows, num_keys))
    value = torch.randn(2, 3, num_keys, 16, generator=g).to(dtype).requires_grad_()
    d_out = torch.randn(2, 3, rows, 16, generator=g).to(dtype)
    ref_out, _, *ref_grads = _dense_reference(q, key, value, keep, 0.3, d_out)
    out = fb.attend_rows(q, key, value, scale=0.3, windows=windows)
    out.backward(d_out)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, key.grad, value.grad),
                               (ref_out, *ref_grads)):
        assert got.dtype == dtype and got.shape == want.shape, name
        assert _rel(got, want) <= BLOCK_TOL[dtype], name


def test_a_large_or_single_segment_call_runs_per_segment(monkeypatch):
    """Above ``MASKED_SCORES`` scores per head, or with one segment, ``attend_rows``
    declines (None) and the segments run one call each."""
    from mindspeed_laga.kernels.nonfinite import Window
    q, key = torch.randn(1, 1, 8, 4), torch.randn(1, 1, 12, 4)
    two = (Window(4, 0, 4, None), Window(4, 0, 12, None))
    assert fb.attend_rows(q, key, key, scale=1.0, windows=two) is not None
    assert fb.attend_rows(q, key, key, scale=1.0, windows=(Window(8, 0, 12, None),)) is None
    monkeypatch.setattr(fb, "MASKED_SCORES", 8 * 12 - 1)
    assert fb.attend_rows(q, key, key, scale=1.0, windows=two) is None


def test_backward_with_final_statistics_splits_exactly():
    """Two key blocks merged by lse, backward of each with the final out/lse, add
    up to the grads of attention over both (what the blockwise walk relies on)."""
    g = torch.Generator().manual_seed(3)
    q, key = torch.randn(1, 2, 6, 12, generator=g), torch.randn(1, 2, 10, 12, generator=g)
    value, d_out = torch.randn(1, 2, 10, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    keep = _staircase(6, 10, 4)
    ref_out, _, *ref_grads = _dense_reference(q, key, value, keep, 0.5, d_out)
    first = fb.FusedBlock.forward(q, key[:, :, :4], value[:, :, :4], None, 0.5)
    second = fb.FusedBlock.forward(q, key[:, :, 4:], value[:, :, 4:], 0, 0.5)
    out, lse = merge_lse([first, second])
    assert _rel(out, ref_out) <= 1e-5
    g1 = fb.FusedBlock.backward(q, key[:, :, :4], value[:, :, :4], None, 0.5, d_out, out, lse)
    g2 = fb.FusedBlock.backward(q, key[:, :, 4:], value[:, :, 4:], 0, 0.5,
                                d_out, out, lse)
    got = (g1[0] + g2[0], torch.cat([g1[1], g2[1]], 2), torch.cat([g1[2], g2[2]], 2))
    for a, b in zip(got, ref_grads):
        assert _rel(a, b) <= 1e-5


@pytest.mark.parametrize("offset,num_keys,calls", [
    (None, 7, [(slice(0, 7), False)]),
    (0, 7, [(slice(0, 7), True)]),
    (3, 7, [(slice(0, 3), False), (slice(3, 7), True)]),
    (7, 7, [(slice(0, 7), False)]),
])
def test_block_calls_cover_every_key_once(offset, num_keys, calls):
    assert block_calls(offset, num_keys) == calls


# ------------------------------------------------------------- kernel selection

def test_kernel_selection_for_recompute():
    cpu = torch.device("cpu")
    assert resolve_kernel("auto", cpu, blockwise=True) == "sdpa"
    assert resolve_kernel("sdpa", cpu, blockwise=True) == "sdpa"
    assert resolve_kernel("eager", cpu, blockwise=True) == "eager"
    assert resolve_kernel("auto", cpu, blockwise=True, dtype=torch.float64) == "sdpa"
    cuda = torch.device("cuda")
    assert resolve_kernel("auto", cuda, blockwise=True, dtype=torch.bfloat16) == "sdpa"
    assert resolve_kernel("auto", cuda, blockwise=True, dtype=torch.float64) == "eager"
    assert resolve_kernel("auto", torch.device("meta"), blockwise=True) == "eager"
    for device, dtype in ((torch.device("meta"), torch.float32), (cuda, torch.float64)):
        with pytest.raises(ValueError, match="use kernel='eager'"):
            resolve_kernel("sdpa", device, blockwise=True, dtype=dtype)


def test_float64_blockwise_sdpa_matches_eager():
    """float64 inputs run on the fused CPU op (it supports float64); the blockwise
    path accumulates in float32 for every kernel, so both agree to float32."""
    from mindspeed_laga import laga_attention
    case = eq.Case(form="laga", kernel="sdpa", shape=eq.MLAShape(seq_len=24))
    x = eq.full_inputs(case.shape, case.seed)
    args = (x["query"], x["kv_latent"], x["k_pos_emb"], x["kv_up_weight"])
    outs = [laga_attention(*args, softmax_scale=0.2, cp_group=None, kernel=k, recompute_kv=True,
                           kv_block_size=5) for k in ("sdpa", "eager")]
    assert outs[0].dtype == torch.float64
    assert _rel(outs[0], outs[1].double()) <= 1e-6


# ------------------------------------------------------------- LAGA blockwise on ranks

SHAPE = eq.MLAShape(seq_len=64)
OPTION_SETS = {
    "recompute": (("recompute_kv", True),),
    "block7": (("recompute_kv", True), ("kv_block_size", 7)),
    "block5+trim": (("recompute_kv", True), ("kv_block_size", 5), ("trim_causal_prefix", True)),
}
CASES = [eq.Case(form="laga", cp_algo=a, layout=l, kernel="sdpa", dtype=d, shape=SHAPE, options=opts)
         for opts, a, l, d in itertools.product(OPTION_SETS.values(), PLAIN_ALGOS,
                                                ("zigzag", "contiguous"), ("float32", "bfloat16"))]
CASES += [eq.Case(form="laga", kernel="sdpa", causal=False, shape=SHAPE, cp_algo=a, dtype=d,
                  options=OPTION_SETS["block7"])
          for a, d in itertools.product(PLAIN_ALGOS, ("float32", "bfloat16"))]
CASES += [eq.Case(form="laga", kernel="auto", shape=SHAPE, cp_algo=a, options=OPTION_SETS["block7"])
          for a in PLAIN_ALGOS]


matrix = cp_matrix(CASES, cp_sizes=(1, 2), timeout_s=240)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fused_blockwise_matches_single_device_reference(matrix, case):
    assert_matches_reference(matrix[case], case)


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_half_precision_push_through_the_rebuild(monkeypatch, kernel):
    """On accelerators the blockwise backward pushes each tile's dK/dV through the rebuild
    in the input dtype (``laga_blockwise.push_dtype``; CPU uses float32). Run that choice
    here: bfloat16 against the float64 reference, one process, row and key blocks."""
    from mindspeed_laga.forms import laga_blockwise
    from mindspeed_laga.tools.measure import run_on_rank
    monkeypatch.setattr(laga_blockwise, "push_dtype", lambda q: q.dtype)
    case = eq.Case(form="laga", kernel=kernel, dtype="bfloat16", shape=SHAPE,
                   options=OPTION_SETS["block7"])
    assert_matches_reference(eq.assemble([run_on_rank(case, 0, 1, None)], case), case)

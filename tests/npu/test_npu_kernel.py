"""kernel="npu" on CPU, through the torch_npu stand-in, against kernel="eager".

The stand-in (tests/support/fake_torch_npu.py, checked in test_fake_torch_npu.py)
implements the documented npu_fusion_attention semantics, so these tests
prove that mindspeed_laga's NPU recipe (key prefix per segment + sparse_mode 3
+ the compressed 2048x2048 mask, BNSD, grouped heads, unpadded v dim) gives
the same outputs and gradients as the eager kernel, for the segment shapes the
CP layouts produce and for the three forms.
"""
from __future__ import annotations

import sys

import pytest
import torch

from mindspeed_laga import absorbed_attention, explicit_attention, laga_attention
from mindspeed_laga.kernels import attend
from mindspeed_laga.vocab.segments import rank_segments

from support import fake_torch_npu

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)


@pytest.fixture
def fake_npu():
    module = fake_torch_npu.install()
    module.reset_calls()
    yield module
    fake_torch_npu.uninstall()


def ulysses_segments(layout_name: str, cp_size: int, local_len: int):
    """Every rank's tokens in rank order (what a ulysses all-to-all delivers)."""
    return [(r * local_len + ls, n, g) for r in range(cp_size)
            for ls, n, g in rank_segments(layout_name, cp_size, r, local_len)]


# (segments, total keys): queries are the concatenated segments, keys are positions [0, total)
SEGMENTS = {
    "single": ([(0, 8, 0)], 8),
    "contiguous_rank2_of4": (rank_segments("contiguous", 4, 2, 4), 16),
    "zigzag_rank0_of2": (rank_segments("zigzag", 2, 0, 8), 16),
    "zigzag_rank1_of2": (rank_segments("zigzag", 2, 1, 8), 16),
    "zigzag_rank2_of4": (rank_segments("zigzag", 4, 2, 6), 24),
    "ulysses_zigzag_4": (ulysses_segments("zigzag", 4, 4), 16),
    "ulysses_contiguous_3": (ulysses_segments("contiguous", 3, 4), 12),
}
# (heads, kv heads, qk head dim, v head dim): per-head MLA (qk > v, unpadded) and absorbed (n_k = 1)
HEADS = {"mla": (4, 4, 12, 8), "absorbed": (4, 1, 20, 16)}


def make_qkv(segments, total, heads, dtype=torch.float32, seed=0):
    n, n_k, d_qk, d_v = heads
    s_q = sum(length for _, length, _ in segments)
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, n, s_q, d_qk, generator=g).to(dtype),
            torch.randn(2, n_k, total, d_qk, generator=g).to(dtype),
            torch.randn(2, n_k, total, d_v, generator=g).to(dtype))


def run(kernel, q, k, v, dy, **kwargs):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attend(*leaves, **kwargs, kernel=kernel)
    grads = torch.autograd.grad(out, leaves, dy)
    return out.detach(), grads


def assert_close_all(got, want, tol):
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("case", sorted(SEGMENTS))
def test_causal_segments_match_eager(fake_npu, case, heads):
    segments, total = SEGMENTS[case]
    q, k, v = make_qkv(segments, total, HEADS[heads])
    dy = torch.randn(q.shape[:3] + (v.shape[-1],), generator=torch.Generator().manual_seed(1))
    kwargs = dict(scale=0.3, segments=segments, causal=True)
    out, grads = run("npu", q, k, v, dy, **kwargs)
    fake_npu_calls = list(fake_npu.calls)
    want_out, want_grads = run("eager", q, k, v, dy, **kwargs)
    assert_close_all((out,) + grads, (want_out,) + want_grads, tol=1e-5)
    # The recipe: one call per segment, keys cut to the causal prefix, right-down causal mode.
    assert len(fake_npu_calls) == len(segments)
    for call, (_, length, start) in zip(fake_npu_calls, segments):
        assert call["input_layout"] == "BNSD" and call["head_num"] == q.shape[1]
        assert call["sparse_mode"] == 3 and call["atten_mask_shape"] == (2048, 2048)
        assert call["query_shape"][2] == length and call["key_shape"][2] == start + length


@pytest.mark.parametrize("heads", sorted(HEADS))
def test_non_causal_matches_eager(fake_npu, heads):
    segments, total = SEGMENTS["zigzag_rank0_of2"]
    q, k, v = make_qkv(segments, total, HEADS[heads], seed=3)
    dy = torch.randn(q.shape[:3] + (v.shape[-1],), generator=torch.Generator().manual_seed(4))
    kwargs = dict(scale=0.25, segments=segments, causal=False)
    got = run("npu", q, k, v, dy, **kwargs)
    want = run("eager", q, k, v, dy, **kwargs)
    assert_close_all((got[0],) + got[1], (want[0],) + want[1], tol=1e-5)
    assert all(c["sparse_mode"] == 0 and c["atten_mask_shape"] is None
               and c["key_shape"][2] == total for c in fake_npu.calls)


def test_bfloat16_matches_eager_loosely(fake_npu):
    """bf16: the fused kernel keeps P in float32, eager rounds it to bf16 first."""
    segments, total = SEGMENTS["ulysses_zigzag_4"]
    q, k, v = make_qkv(segments, total, HEADS["mla"], dtype=torch.bfloat16, seed=5)
    dy = torch.randn(q.shape[:3] + (v.shape[-1],), generator=torch.Generator().manual_seed(6))
    kwargs = dict(scale=0.3, segments=segments, causal=True)
    got = run("npu", q, k, v, dy.bfloat16(), **kwargs)
    want = run("eager", q, k, v, dy.bfloat16(), **kwargs)
    assert got[0].dtype == torch.bfloat16
    assert_close_all((got[0],) + got[1], (want[0],) + want[1], tol=5e-2)


# ------------------------------------------------------------ packed documents (TND)

DOCUMENTS = {"one": [0, 16], "two": [0, 5, 16], "many": [0, 2, 4, 6, 8, 10, 12, 14, 16],
             "ragged": [0, 1, 7, 8, 13, 16]}


@pytest.mark.parametrize("pad_v", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("docs", sorted(DOCUMENTS))
@pytest.mark.parametrize("case", ["zigzag_rank0_of2", "zigzag_rank1_of2", "single"])
def test_documents_match_eager_in_one_tnd_call_per_segment(fake_npu, case, docs, heads, causal,
                                                           pad_v):
    """Eager masks each segment from its pieces; the NPU kernel packs them as varlen
    sequences: one call per segment whatever the number of documents."""
    segments, total = SEGMENTS[case]
    if total != DOCUMENTS[docs][-1]:
        segments, total = [(0, 16, 0)], 16
    q, k, v = (x[:1] for x in make_qkv(segments, total, HEADS[heads], seed=8))
    dy = torch.randn(q.shape[:3] + (v.shape[-1],), generator=torch.Generator().manual_seed(9))
    kwargs = dict(scale=0.3, segments=segments, causal=causal, documents=DOCUMENTS[docs])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attend(*leaves, **kwargs, kernel="npu", pad_v=pad_v)
    got = (out.detach(),) + torch.autograd.grad(out, leaves, dy)
    calls = list(fake_npu.calls)
    want_out, want_grads = run("eager", q, k, v, dy, **kwargs)
    assert_close_all(got, (want_out,) + want_grads, tol=1e-5)
    assert len(calls) == len(segments)
    for call in calls:
        assert call["input_layout"] == "TND" and len(call["query_shape"]) == 3
        assert call["sparse_mode"] == (3 if causal else 0)
        assert call["atten_mask_shape"] == ((2048, 2048) if causal else None)
        assert call["value_shape"][-1] == (k.shape[-1] if pad_v else v.shape[-1])


def test_documents_need_micro_batch_one(fake_npu):
    segments, total = SEGMENTS["single"]
    q, k, v = make_qkv(segments, total, HEADS["mla"])
    with pytest.raises(ValueError, match="micro-batch size 1"):
        attend(q, k, v, scale=0.3, segments=segments, causal=True, kernel="npu",
               documents=[0, 3, 8])


# ------------------------------------------------------------ the three forms, no CP

FORMS = {"laga": laga_attention, "explicit": explicit_attention, "absorbed": absorbed_attention}


def mla_inputs(s=8, b=2, n=4, d_n=8, d_r=4, d_v=6, d_c=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(s, b, n, d_n + d_r, generator=g),
            torch.randn(s, b, d_c, generator=g),
            torch.randn(s, b, d_r, generator=g),
            torch.randn(n * (d_n + d_v), d_c, generator=g) / d_c ** 0.5)


def run_form(form, kernel, inputs, dy, **kwargs):
    leaves = [x.clone().requires_grad_() for x in inputs]
    # mla_inputs' head dims (d_v != d_n here, so the core needs them stated)
    d_n = inputs[0].shape[-1] - inputs[2].shape[-1]
    kwargs.setdefault("qk_head_dim", d_n)
    kwargs.setdefault("v_head_dim", inputs[3].shape[0] // inputs[0].shape[2] - d_n)
    out = FORMS[form](*leaves, softmax_scale=0.3, kernel=kernel, **kwargs)
    return (out.detach(),) + torch.autograd.grad(out, leaves, dy)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_forms_match_eager_without_cp(fake_npu, form, causal):
    inputs = mla_inputs()
    dy = torch.randn(8, 2, 4 * 6, generator=torch.Generator().manual_seed(9))
    got = run_form(form, "npu", inputs, dy, causal=causal)
    assert fake_npu.calls, "kernel='npu' did not reach torch_npu.npu_fusion_attention"
    calls = list(fake_npu.calls)
    want = run_form(form, "eager", inputs, dy, causal=causal)
    assert_close_all(got, want, tol=1e-5)
    n_k, d_qk = (1, 16 + 4) if form == "absorbed" else (4, 8 + 4)
    assert all(c["key_shape"][1] == n_k and c["key_shape"][3] == d_qk for c in calls)
    assert all(c["sparse_mode"] == (3 if causal else 0) for c in calls)


def test_laga_trimmed_prefix_matches_eager(fake_npu):
    inputs = mla_inputs(seed=2)
    dy = torch.randn(8, 2, 4 * 6, generator=torch.Generator().manual_seed(3))
    got = run_form("laga", "npu", inputs, dy, trim_causal_prefix=True)
    want = run_form("laga", "eager", inputs, dy, trim_causal_prefix=True)
    assert_close_all(got, want, tol=1e-5)


# ------------------------------------------------------------ the block kernel, no dense mask

COMPRESSED = (2048, 2048)


def block_inputs(rows, keys, d_qk=12, d_v=8, heads=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, heads, rows, d_qk, generator=g),
            torch.randn(2, heads, keys, d_qk, generator=g),
            torch.randn(2, heads, keys, d_v, generator=g))


def block_reference(q, key, value, diagonal, scale):
    """Float64 (out, lse) of one block from the visibility rule itself."""
    s = torch.matmul(q, key.transpose(-1, -2)) * scale
    if diagonal is not None:
        rows, keys = q.shape[2], key.shape[2]
        hidden = torch.tensor([[j > i + diagonal for j in range(keys)] for i in range(rows)])
        s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), value), lse


# (rows, keys, diagonal): the walk's range max(0, keys - rows) <= diagonal < keys - 1, at
# sizes and offsets that are multiples of nothing; None = every key visible.
BLOCKS = [(7, 13, 6), (7, 13, 8), (13, 7, 0), (13, 7, 4), (37, 20, 2), (5, 37, 33),
          (13, 13, 0), (13, 13, 7), (20, 37, 17), (37, 37, None), (11, 5, None)]


@pytest.mark.parametrize("pad_v", [False, True], ids=["unpadded", "pad_v"])
@pytest.mark.parametrize("rows,keys,diagonal", BLOCKS)
def test_npu_block_kernel_matches_float64(fake_npu, rows, keys, diagonal, pad_v):
    from mindspeed_laga.kernels.block import block_kernel
    kernel = block_kernel("npu", pad_v)
    q, key, value = block_inputs(rows, keys, seed=rows * keys)
    leaves = [x.double().requires_grad_() for x in (q, key, value)]
    want_out, want_lse = block_reference(*leaves, diagonal, 0.3)
    out, lse = kernel.forward(q, key, value, diagonal, 0.3)
    assert_close_all((out, lse), (want_out, want_lse), tol=1e-5)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    got = kernel.backward(q, key, value, diagonal, 0.3, d_out, out, lse)
    want = torch.autograd.grad(want_out, leaves, d_out.double())
    assert_close_all(got, want, tol=1e-5)
    assert [g.shape for g in got] == [q.shape, key.shape, value.shape]
    # The recipe: no mask when all is visible, else the compressed mask in mode 3 or 4.
    assert [c["name"] for c in fake_npu.calls] == ["npu_fusion_attention",
                                                   "npu_fusion_attention_grad"]
    for call in fake_npu.calls:
        assert call["value_shape"][3] == (key.shape[3] if pad_v else value.shape[3])
        if diagonal is None:
            assert call["sparse_mode"] == 0 and call["atten_mask_shape"] is None
        elif diagonal == keys - rows:
            assert call["sparse_mode"] == 3 and call["atten_mask_shape"] == COMPRESSED
        else:
            assert call["sparse_mode"] == 4 and call["atten_mask_shape"] == COMPRESSED
            assert call["next_tockens"] == diagonal - (keys - rows)
    assert fake_npu.largest_mask_elements <= 2048 * 2048


def test_block_walk_diagonals_follow_positions():
    """Every (block, segment) pair the walk yields: its diagonal describes exactly
    "key position <= query position", within the range the block kernels rely on."""
    from mindspeed_laga.kernels.masks import keep_mask
    from mindspeed_laga.forms.laga_blockwise import BlockPlan, visible_rows
    from mindspeed_laga.vocab.dims import MLADims
    from mindspeed_laga.vocab.keys import key_blocks
    for segments, total in SEGMENTS.values():
        for block_size in (1, 5, 7, 13, 37):
            plan = BlockPlan(dims=MLADims(1, 2, 1, 2, 2), scale=1.0, causal=True,
                             segments=tuple(segments), block_size=block_size)
            positions = torch.tensor([g + i for _, n, g in segments for i in range(n)])
            seen = torch.zeros(len(positions), total, dtype=torch.bool)
            for k0, k1 in key_blocks(total, block_size):
                for rows, keys, offset in visible_rows(plan, k0, k1):
                    assert keys.start == 0  # without documents a run's keys start the block
                    end = keys.stop
                    q_pos = positions[rows]
                    want = torch.arange(k0, k0 + end).unsqueeze(0) <= q_pos.unsqueeze(1)
                    got = keep_mask(len(q_pos), end, offset, "cpu")
                    assert torch.equal(want, torch.ones_like(want) if got is None else got)
                    if offset is not None:
                        assert max(0, end - len(q_pos)) <= offset < end - 1
                    seen[rows, k0:k0 + end] |= want
            assert torch.equal(seen, torch.arange(total).unsqueeze(0) <= positions.unsqueeze(1))


@pytest.mark.parametrize("block_size", [7, 13, 37])
@pytest.mark.parametrize("pad_v", [False, True], ids=["unpadded", "pad_v"])
def test_blockwise_laga_odd_blocks_match_float64(fake_npu, block_size, pad_v):
    """Blockwise LAGA on the NPU block kernel at block sizes that align with nothing:
    output and all four grads against the float64 reference; no mask but the
    compressed one reaches the op, whatever the sequence length."""
    from mindspeed_laga.reference import mla_attention_reference
    inputs = mla_inputs(s=41, seed=block_size)
    dy = torch.randn(41, 2, 4 * 6, generator=torch.Generator().manual_seed(1))
    got = run_form("laga", "npu", inputs, dy, recompute_kv=True, kv_block_size=block_size,
                   pad_v=pad_v)
    leaves = [x.double().requires_grad_() for x in inputs]
    want_out = mla_attention_reference(*leaves, softmax_scale=0.3)
    want = (want_out.detach(),) + torch.autograd.grad(want_out, leaves, dy.double())
    assert_close_all(got, want, tol=1e-5)
    masks = {c["atten_mask_shape"] for c in fake_npu.calls}
    assert masks <= {None, COMPRESSED}, masks
    assert {c["sparse_mode"] for c in fake_npu.calls} >= {3, 4}
    assert fake_npu.largest_mask_elements <= 2048 * 2048
    assert all((c["value_shape"][3] == c["key_shape"][3]) == pad_v for c in fake_npu.calls)


# ------------------------------------------------------------ pad_v: V padded as the host does

def test_segment_kernel_pad_v_equals_unpadded(fake_npu):
    segments, total = SEGMENTS["zigzag_rank2_of4"]
    q, k, v = make_qkv(segments, total, HEADS["mla"], seed=8)
    dy = torch.randn(q.shape[:3] + (v.shape[-1],), generator=torch.Generator().manual_seed(9))
    kwargs = dict(scale=0.3, segments=segments, causal=True)
    padded = run("npu", q, k, v, dy, pad_v=True, **kwargs)
    assert all(c["value_shape"][3] == k.shape[3] for c in fake_npu.calls)
    fake_npu.reset_calls()
    plain = run("npu", q, k, v, dy, pad_v=False, **kwargs)
    assert all(c["value_shape"][3] == v.shape[3] for c in fake_npu.calls)
    assert padded[0].shape == plain[0].shape and padded[1][2].shape == v.shape
    assert_close_all((padded[0],) + padded[1], (plain[0],) + plain[1], tol=1e-6)


PAD_V_CASES = [(form, {}) for form in sorted(FORMS)] + [
    ("laga", {"trim_causal_prefix": True}), ("laga", {"recompute_kv": True, "kv_block_size": 3})]


@pytest.mark.parametrize("form,options", PAD_V_CASES, ids=str)
def test_forms_pad_v_equal_unpadded(fake_npu, form, options):
    inputs = mla_inputs(seed=4)
    dy = torch.randn(8, 2, 4 * 6, generator=torch.Generator().manual_seed(5))
    padded = run_form(form, "npu", inputs, dy, pad_v=True, **options)
    assert fake_npu.calls and all(c["value_shape"][3] == c["key_shape"][3]
                                  for c in fake_npu.calls)
    plain = run_form(form, "npu", inputs, dy, pad_v=False, **options)
    assert_close_all(padded, plain, tol=1e-6)


def test_pad_v_is_ignored_by_other_kernels_and_checked():
    inputs = mla_inputs(seed=6)
    dy = torch.randn(8, 2, 4 * 6, generator=torch.Generator().manual_seed(7))
    assert_close_all(run_form("laga", "eager", inputs, dy, pad_v=True),
                     run_form("laga", "eager", inputs, dy), tol=0)
    for form in FORMS.values():
        with pytest.raises(ValueError, match="pad_v"):
            form(*mla_inputs(), softmax_scale=0.3, kernel="eager", pad_v="yes")


def test_mindspeed_llm_flag_decides_pad_v():
    """MindSpeed-LLM pads V unless its own --mla-fa-without-pad is given; so does LAGA."""
    from argparse import Namespace
    from mindspeed_laga.features.laga_args import laga_settings
    padded = laga_settings(Namespace(context_parallel_algo="kvallgather_cp_algo"))
    unpadded = laga_settings(Namespace(context_parallel_algo="kvallgather_cp_algo",
                                       mla_fa_without_pad=True))
    assert padded.core_options()["pad_v"] is True and unpadded.core_options()["pad_v"] is False


# ------------------------------------------------------------ no torch_npu

def test_npu_kernel_without_torch_npu_names_it(monkeypatch):
    fake_torch_npu.uninstall()
    # None in sys.modules makes `import torch_npu` fail even where a real one is installed.
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    segments, total = SEGMENTS["single"]
    q, k, v = make_qkv(segments, total, HEADS["mla"])
    with pytest.raises(ValueError, match="torch_npu"):
        attend(q, k, v, scale=0.3, segments=segments, causal=True, kernel="npu")
    for form in FORMS.values():
        with pytest.raises(ValueError, match="torch_npu"):
            form(*mla_inputs(), softmax_scale=0.3, kernel="npu", qk_head_dim=8, v_head_dim=6)

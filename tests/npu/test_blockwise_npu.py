"""kernel="npu" on gloo ranks through the CPU stand-in torch_npu: every form, both
CP algos, both layouts, LAGA's options (blockwise recompute at block sizes that
align with nothing, prefix trimming, overlap) and ``pad_v``: output and all
grads against the float64 single-device reference. The stand-in's kernels
really were called, and no mask but the compressed 2048x2048 one reached them."""
import itertools

import pytest

from mindspeed_laga.tools import equivalence as eq
from mindspeed_laga.tools.measure import worker
from mindspeed_laga.tools.spawn import run_on_ranks

from support.references import assemble_by_case, assert_matches_reference, case_id

from support import fake_torch_npu
from support.variants import PLAIN_ALGOS

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

SHAPE = eq.MLAShape(seq_len=32)
ALGOS, LAYOUTS = PLAIN_ALGOS, ("zigzag", "contiguous")
RECOMPUTE = (("recompute_kv", True),)
BLOCK_OPTIONS = [RECOMPUTE,
                 RECOMPUTE + (("kv_block_size", 6), ("trim_causal_prefix", True), ("overlap", True)),
                 RECOMPUTE + (("kv_block_size", 7), ("pad_v", True)),
                 RECOMPUTE + (("kv_block_size", 13), ("trim_causal_prefix", True), ("pad_v", True))]
CASES = [eq.Case(form="laga", cp_algo=a, layout=l, kernel="npu", dtype=d, shape=SHAPE, options=o)
         for a, l, d, o in itertools.product(ALGOS, LAYOUTS, ("float32", "bfloat16"), BLOCK_OPTIONS)]
# Non-causal blockwise: every block is fully visible (no mask at all).
CASES += [eq.Case(form="laga", cp_algo=a, layout=l, kernel="npu", causal=False, shape=SHAPE,
                  options=RECOMPUTE + (("kv_block_size", 5),))
          for a, l in itertools.product(ALGOS, LAYOUTS)]
# The segment kernel of every form, V unpadded and padded; LAGA's other options with pad_v.
CASES += [eq.Case(form=f, cp_algo=a, layout=l, kernel="npu", shape=SHAPE, options=o)
          for f, a, l, o in itertools.product(("explicit", "absorbed", "laga"), ALGOS, LAYOUTS,
                                              ((), (("pad_v", True),)))]
CASES += [eq.Case(form="laga", cp_algo=a, layout=l, kernel="npu", shape=SHAPE,
                  options=(("trim_causal_prefix", True), ("overlap", True), ("pad_v", True)))
          for a, l in itertools.product(ALGOS, LAYOUTS)]


def npu_worker(rank, cp_size, cases):
    module = fake_torch_npu.install()
    module.reset_calls()
    results = worker(rank, cp_size, cases)
    calls = module.calls
    return (results, sorted({c["name"] for c in calls}),
            sorted({str(c["atten_mask_shape"]) for c in calls}),
            sorted({c["sparse_mode"] for c in calls}), module.largest_mask_elements)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"cp{p}")
def matrix(request):
    """One spawn per CP size (bounded: a hang fails); without CP see test_npu_kernel.py."""
    per_rank = run_on_ranks(npu_worker, request.param, CASES, timeout_s=600)
    for _, names, masks, modes, largest in per_rank:
        assert names == ["npu_fusion_attention", "npu_fusion_attention_grad"], names
        assert masks == ["(2048, 2048)", "None"], masks
        assert modes == [0, 3, 4], modes
        assert largest == 2048 * 2048
    return assemble_by_case([results for results, *_ in per_rank], CASES)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_npu_matches_reference(matrix, case):
    assert_matches_reference(matrix[case], case)


# ------------------------------------------------------------ packed runs (documents)

# One segment's runs against a block of 10 keys: (rows, key slice, diagonal) as the walk
# hands them, diagonals within the interface's max(0, B - rows) <= c < B - 1.
RUNS = [(slice(0, 3), slice(0, 4), 1), (slice(3, 7), slice(4, 10), 2), (slice(7, 9), slice(4, 10), None),
        (slice(9, 14), slice(6, 10), 0)]


@pytest.mark.parametrize("pad_v", [False, True])
@pytest.mark.parametrize("n", [1, 4])
def test_packed_runs_match_eager_per_run_in_two_calls(pad_v, n):
    """forward_runs/backward_runs of the NPU block kernel against EagerBlock run by run:
    the causal parts go in one mode-3 TND call, the fully visible parts in one mode-0 call."""
    import torch
    from mindspeed_laga.kernels.block import block_kernel
    from mindspeed_laga.kernels.eager import EagerBlock
    module = fake_torch_npu.install()
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, n, 14, 12, generator=g)
        key = torch.randn(1, n, 10, 12, generator=g)
        value = torch.randn(1, n, 10, 8, generator=g)
        d_out = torch.randn(1, n, 14, 8, generator=g)
        kernel = block_kernel("npu", pad_v)
        module.reset_calls()
        got = kernel.forward_runs(q, key, value, RUNS, 0.3)
        forward_calls = list(module.calls)
        out = torch.zeros(1, n, 14, 8)
        lse = torch.zeros(1, n, 14)
        for (rows, ks, c), (o, l) in zip(RUNS, got):
            want_o, want_l = EagerBlock.forward(q[:, :, rows], key[:, :, ks], value[:, :, ks], c, 0.3)
            torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(l, want_l, atol=1e-5, rtol=1e-5)
            out[:, :, rows], lse[:, :, rows] = want_o, want_l
        module.reset_calls()
        grads = kernel.backward_runs(q, key, value, RUNS, 0.3, d_out, out, lse)
        backward_calls = list(module.calls)
        for (rows, ks, c), got_g in zip(RUNS, grads):
            want_g = EagerBlock.backward(q[:, :, rows], key[:, :, ks], value[:, :, ks], c, 0.3,
                                         d_out[:, :, rows], out[:, :, rows], lse[:, :, rows])
            for a, b in zip(got_g, want_g):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        for calls in (forward_calls, backward_calls):
            assert [(c["input_layout"], c["sparse_mode"]) for c in calls] == [("TND", 3), ("TND", 0)]
            assert calls[0]["atten_mask_shape"] == (2048, 2048) and calls[1]["atten_mask_shape"] is None
    finally:
        fake_torch_npu.uninstall()

"""kernel="npu" on gloo ranks through the CPU stand-in torch_npu: every form, both
CP algos, both layouts, LAGA's options (blockwise recompute at block sizes that
align with nothing, prefix trimming, overlap) and ``pad_v``: output and all
grads against the float64 single-device reference. The stand-in's kernels
really were called, and no mask but the compressed 2048x2048 one reached them."""
import itertools

import pytest

from mindspeed_laga import equivalence as eq
from mindspeed_laga.spawn import run_on_ranks

from test_equivalence import TOLERANCE, reference

try:
    from . import fake_torch_npu
except ImportError:  # tests/ is not a package
    import fake_torch_npu

SHAPE = eq.MLAShape(seq_len=32)
ALGOS, LAYOUTS = ("allgather", "ulysses"), ("zigzag", "contiguous")
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
    results = eq.worker(rank, cp_size, cases)
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
    return {case: eq.assemble([r[0][i] for r in per_rank], case) for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label() + ("" if c.causal else ",noncausal"))
def test_npu_matches_reference(matrix, case):
    errors = eq.relative_errors(matrix[case], reference(case))
    bad = {k: v for k, v in errors.items() if not v <= TOLERANCE[case.dtype]}
    assert not bad, f"{case.label()}: {bad} > {TOLERANCE[case.dtype]}"

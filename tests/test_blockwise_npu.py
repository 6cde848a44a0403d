"""The blockwise (recompute) LAGA on the NPU block kernel, through the CPU
stand-in torch_npu, on gloo ranks: output and all grads against the float64
single-device reference, and the stand-in's kernels really were called."""
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
OPTIONS = [(("recompute_kv", True),),
           (("recompute_kv", True), ("kv_block_size", 6), ("trim_causal_prefix", True), ("overlap", True))]
CASES = [eq.Case(form="laga", cp_algo=a, layout=l, kernel="npu", dtype=d, shape=SHAPE, options=o)
         for a, l, d, o in itertools.product(("allgather", "ulysses"), ("zigzag", "contiguous"),
                                             ("float32", "bfloat16"), OPTIONS)]


def npu_worker(rank, cp_size, cases):
    module = fake_torch_npu.install()
    results = eq.worker(rank, cp_size, cases)
    return results, sorted({call["name"] for call in module.calls})


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"cp{p}")
def matrix(request):
    per_rank = run_on_ranks(npu_worker, request.param, CASES)
    for _, names in per_rank:
        assert names == ["npu_fusion_attention", "npu_fusion_attention_grad"], names
    return {case: eq.assemble([r[0][i] for r in per_rank], case) for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label())
def test_npu_blockwise_matches_reference(matrix, case):
    errors = eq.relative_errors(matrix[case], reference(case))
    bad = {k: v for k, v in errors.items() if not v <= TOLERANCE[case.dtype]}
    assert not bad, f"{case.label()}: {bad} > {TOLERANCE[case.dtype]}"

"""LAGA's options beyond the paper (recompute, blockwise rebuild, causal prefix
trimming, overlapped gather), each on and all together, against the float64
single-device reference: output and all four grads, for both cp_algos, both
layouts and CP sizes 1, 2, 4, 8. Tolerances as in test_equivalence."""
import itertools

import pytest

from mindspeed_laga import equivalence as eq
from mindspeed_laga.spawn import run_on_ranks

from test_equivalence import TOLERANCE

SHAPE = eq.MLAShape(seq_len=64)
ALL_ON = (("recompute_kv", True), ("kv_block_size", 8), ("trim_causal_prefix", True), ("overlap", True))
OPTION_SETS = {
    "trim": ((("trim_causal_prefix", True),), ("eager", "sdpa")),
    "recompute": ((("recompute_kv", True),), ("eager",)),
    "blockwise": ((("recompute_kv", True), ("kv_block_size", 8)), ("eager",)),
    "blockwise-uneven": ((("recompute_kv", True), ("kv_block_size", 7)), ("eager",)),
    "overlap": ((("overlap", True),), ("eager", "sdpa")),
    "all": (ALL_ON, ("eager",)),
}
CASES = [eq.Case(form="laga", cp_algo=a, layout=l, kernel=k, dtype=d, shape=SHAPE, options=opts)
         for (opts, kernels), a, l, d in itertools.product(
             OPTION_SETS.values(), ("allgather", "ulysses"), ("zigzag", "contiguous"),
             ("float32", "bfloat16"))
         for k in kernels]
CASES += [eq.Case(form="laga", kernel="eager", causal=False, shape=SHAPE, options=ALL_ON, cp_algo=a)
          for a in ("allgather", "ulysses")]


@pytest.fixture(scope="module", params=[1, 2, 4, 8], ids=lambda p: f"cp{p}")
def matrix(request):
    per_rank = run_on_ranks(eq.worker, request.param, CASES)
    return {case: eq.assemble([r[i] for r in per_rank], case) for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label() + ("" if c.causal else ",noncausal"))
def test_option_matches_single_device_reference(matrix, case):
    errors = eq.relative_errors(matrix[case], eq.reference(case))
    bad = {k: v for k, v in errors.items() if not v <= TOLERANCE[case.dtype]}
    assert not bad, f"{case.label()}: {bad} > {TOLERANCE[case.dtype]}"

"""Every form x cp_algo x layout x CP size x kernel x dtype against the float64
single-device reference on the full sequence: the output and all four grads.

Tolerances (relative to the largest reference magnitude):
- float32: 1e-5 (measured ~6e-7).
- bfloat16: 1.6e-2. bf16 keeps 8 significant bits (unit roundoff u = 2^-9).
  Between the inputs and each compared tensor the forms store at most ~6
  intermediates in bf16 (K/V or q_abs, probabilities, output; in backward
  dO.V^T, dS, dK/dV or the latent grad) and bf16 matmuls round once more on
  output, so |error| <= ~8u = 1.6% of the magnitude; measured ~0.8%.
"""
import functools
import itertools

import pytest

from mindspeed_laga.tools import equivalence as eq
from mindspeed_laga.tools.runspec import standard_runs
from mindspeed_laga.tools.spawn import run_on_ranks
from mindspeed_laga.vocab.names import CP_ALGOS, SEQUENCE_LAYOUTS as LAYOUTS

TOLERANCE = {"float32": 1e-5, "bfloat16": 8 * 2.0 ** -9}
FORMS = standard_runs(forms_only=True)  # explicit, absorbed, LAGA without options
KERNELS = ("eager", "sdpa")
DTYPES = ("float32", "bfloat16")

# The float64 reference depends on the case alone: computed once, checked against every CP size.
reference = functools.lru_cache(maxsize=None)(eq.reference)

CASES = [eq.Case(spec=f, cp_algo=a, layout=l, kernel=k, dtype=d)
         for f, a, l, k, d in itertools.product(FORMS, CP_ALGOS, LAYOUTS, KERNELS, DTYPES)]
# Non-causal attention (every key visible) is supported with both layouts too.
CASES += [eq.Case(spec=f, cp_algo=a, layout=l, kernel=k, causal=False)
          for f, a, l, k in itertools.product(FORMS, CP_ALGOS, LAYOUTS, KERNELS)]


@pytest.fixture(scope="module", params=[1, 2, 4, 8], ids=lambda p: f"cp{p}")
def matrix(request):
    """One spawn per CP size runs the whole matrix; results by case."""
    cp_size = request.param
    per_rank = run_on_ranks(eq.worker, cp_size, CASES)
    return {case: eq.assemble([r[i] for r in per_rank], case) for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label() + ("" if c.causal else ",noncausal"))
def test_matches_single_device_reference(matrix, case):
    errors = eq.relative_errors(matrix[case], reference(case))
    bad = {k: v for k, v in errors.items() if not v <= TOLERANCE[case.dtype]}
    assert not bad, f"{case.label()}: {bad} > {TOLERANCE[case.dtype]}"

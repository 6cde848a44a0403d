"""Tolerances against the float64 single-device reference, the cached reference itself, and
the check of a case's assembled result against it (with the matrix fixture that runs a
module's cases at each CP size).

Tolerances (relative to the largest reference magnitude):
- float32: 1e-5 (measured ~6e-7).
- bfloat16: 1.6e-2. bf16 keeps 8 significant bits (unit roundoff u = 2^-9).
  Between the inputs and each compared tensor the forms store at most ~6
  intermediates in bf16 (K/V or q_abs, probabilities, output; in backward
  dO.V^T, dS, dK/dV or the latent grad) and bf16 matmuls round once more on
  output, so |error| <= ~8u = 1.6% of the magnitude; measured ~0.8%.
"""
import functools

import pytest

from mindspeed_laga.tools import equivalence as eq
from mindspeed_laga.tools.measure import worker
from mindspeed_laga.tools.spawn import run_on_ranks

TOLERANCE = {"float32": 1e-5, "bfloat16": 8 * 2.0 ** -9}

# The float64 reference depends on the case alone: computed once, checked against every CP size.
reference = functools.lru_cache(maxsize=None)(eq.reference)


def case_id(case) -> str:
    """A case's test id: its label, and ",noncausal" where every key is visible."""
    return case.label() + ("" if case.causal else ",noncausal")


def assemble_by_case(per_rank, cases):
    """{case: the full-sequence result}, from each rank's results in the order of ``cases``."""
    return {case: eq.assemble([r[i] for r in per_rank], case) for i, case in enumerate(cases)}


def assert_matches_reference(result, case):
    """The output and all four grads within the tolerance of the case's dtype."""
    errors = eq.relative_errors(result, reference(case))
    bad = {k: v for k, v in errors.items() if not v <= TOLERANCE[case.dtype]}
    assert not bad, f"{case.label()}: {bad} > {TOLERANCE[case.dtype]}"


def cp_matrix(cases, cp_sizes=(1, 2, 4, 8), timeout_s: float = 300):
    """The module's fixture ``matrix = cp_matrix(CASES)``: at each CP size one spawn
    (bounded by ``timeout_s``) runs every case; results by case."""
    @pytest.fixture(scope="module", params=list(cp_sizes), ids=lambda p: f"cp{p}")
    def matrix(request):
        return assemble_by_case(run_on_ranks(worker, request.param, cases, timeout_s=timeout_s),
                                cases)
    return matrix

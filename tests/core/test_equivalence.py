"""Every form x cp_algo x layout x CP size x kernel x dtype against the float64
single-device reference on the full sequence: the output and all four grads.

Tolerances: tests/support/references.py.
"""
import itertools

import pytest

from mindspeed_laga.tools import equivalence as eq
from mindspeed_laga.tools.runspec import standard_runs
from mindspeed_laga.tools.measure import worker
from mindspeed_laga.tools.spawn import run_on_ranks
from mindspeed_laga.vocab.names import CP_ALGOS, SEQUENCE_LAYOUTS as LAYOUTS
from support.references import TOLERANCE, reference

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

FORMS = standard_runs(forms_only=True)  # explicit, absorbed, LAGA without options
KERNELS = ("eager", "sdpa")
DTYPES = ("float32", "bfloat16")

CASES = [eq.Case(spec=f, cp_algo=a, layout=l, kernel=k, dtype=d)
         for f, a, l, k, d in itertools.product(FORMS, CP_ALGOS, LAYOUTS, KERNELS, DTYPES)]
# Non-causal attention (every key visible) is supported with both layouts too.
CASES += [eq.Case(spec=f, cp_algo=a, layout=l, kernel=k, causal=False)
          for f, a, l, k in itertools.product(FORMS, CP_ALGOS, LAYOUTS, KERNELS)]


@pytest.fixture(scope="module", params=[1, 2, 4, 8], ids=lambda p: f"cp{p}")
def matrix(request):
    """One spawn per CP size runs the whole matrix; results by case."""
    cp_size = request.param
    per_rank = run_on_ranks(worker, cp_size, CASES)
    return {case: eq.assemble([r[i] for r in per_rank], case) for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label() + ("" if c.causal else ",noncausal"))
def test_matches_single_device_reference(matrix, case):
    errors = eq.relative_errors(matrix[case], reference(case))
    bad = {k: v for k, v in errors.items() if not v <= TOLERANCE[case.dtype]}
    assert not bad, f"{case.label()}: {bad} > {TOLERANCE[case.dtype]}"

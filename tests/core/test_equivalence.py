"""Every form x cp_algo x layout x CP size x kernel x dtype against the float64
single-device reference on the full sequence: the output and all four grads.

Tolerances: tests/support/references.py.
"""
import itertools

import pytest

from mindspeed_laga.tools import equivalence as eq
from mindspeed_laga.tools.runspec import standard_runs
from mindspeed_laga.vocab.names import SEQUENCE_LAYOUTS as LAYOUTS
from support.references import assert_matches_reference, case_id, cp_matrix
from support.variants import CPU_KERNELS as KERNELS, PLAIN_ALGOS as CP_ALGOS

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

FORMS = standard_runs(forms_only=True)  # explicit, absorbed, LAGA without options
DTYPES = ("float32", "bfloat16")

CASES = [eq.Case(spec=f, cp_algo=a, layout=l, kernel=k, dtype=d)
         for f, a, l, k, d in itertools.product(FORMS, CP_ALGOS, LAYOUTS, KERNELS, DTYPES)]
# Non-causal attention (every key visible) is supported with both layouts too.
CASES += [eq.Case(spec=f, cp_algo=a, layout=l, kernel=k, causal=False)
          for f, a, l, k in itertools.product(FORMS, CP_ALGOS, LAYOUTS, KERNELS)]


matrix = cp_matrix(CASES)  # one spawn per CP size (1, 2, 4, 8) runs the whole matrix


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_single_device_reference(matrix, case):
    assert_matches_reference(matrix[case], case)

"""Key padding with kernel="npu" on CPU through the torch_npu stand-in (its dense
``atten_mask`` B1SS in sparse mode 0, True = masked, and ``inner_precise=2`` for rows a
block masks wholly): every form, the paper's LAGA and the blockwise walk, V padded or not,
right and left padding at micro-batch 2, at CP 1 and 2, in float32 against the float64
single-process reference of tests/support/key_padding.py (outputs and every grad)."""
from __future__ import annotations

import pytest
import torch

from support import case_runs
from support import fake_torch_npu
from support.key_padding import FORMS_BY_NAME, assemble, padding_mask, reference, run_case, worker

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

TOLERANCE = 2e-5  # float32 kernel against float64, relative to the largest reference value
LAGA_OPTIONS = [{}, {"recompute_kv": True, "kv_block_size": 5, "trim_causal_prefix": True}]


def cases(cp):
    out = []
    for form in FORMS_BY_NAME:
        for side, algo, lay, pad_v in (("left", "ulysses", "contiguous", True),
                                       ("right", "allgather", "zigzag", False)):
            for opts in LAGA_OPTIONS if form == "laga" else [{}]:
                out.append(dict(form=form, cp_algo=algo, layout=lay, side=side, kernel="npu",
                                causal=True, empty_rows="mean", dtype=torch.float32,
                                options=dict(opts, pad_v=pad_v)))
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cp", [1, 2])
def test_npu_key_padding_matches_reference(cp):
    todo = cases(cp)
    per_case = case_runs.per_case(run_case, worker, cp, todo, npu_standin=True)
    failures = []
    for case, per_rank in zip(todo, per_case):
        ref_out, ref_grads = reference(padding_mask(case["side"]), True, "mean")
        out, grads = assemble(per_rank, case["layout"], cp)
        pairs = [(out, ref_out)] + [(grads[k], ref_grads[k]) for k in ref_grads]
        errs = [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in pairs]
        err = float("nan") if any(e != e for e in errs) else max(errs)  # a NaN fails
        if not err <= TOLERANCE:
            failures.append(f"{case['form']}-{case['side']}-{case['options']}: {err:.2e}")
    assert not failures, "\n".join(failures)


def test_a_wholly_masked_row_needs_inner_precise_2():
    """The stand-in is as strict as the reference: a user mask that masks a whole row
    without the invalid-row switch is refused; with it the row is zero."""
    module = fake_torch_npu.install()
    try:
        q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
        mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
        mask[0, 0, 1] = True
        with pytest.raises(fake_torch_npu.FakeNpuError, match="inner_precise=2"):
            module.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=mask, sparse_mode=0)
        out = module.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=mask, sparse_mode=0,
                                          inner_precise=2)[0]
        assert torch.equal(out[0, :, 1], torch.zeros(2, 8)) and out[0, :, 0].abs().sum() > 0
    finally:
        fake_torch_npu.uninstall()

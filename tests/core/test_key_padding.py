"""Key padding (``key_padding_mask``): every form, kernel, CP algorithm, layout and LAGA
option on 1, 2 and 4 gloo ranks against a float64 single-process attention of the full
sequence (tests/support/key_padding.py), outputs and every grad; micro-batch 2 with a
different pad length per sample, right and left padding. All cases of one CP size run in
one spawned job; pytest then checks them."""
from __future__ import annotations

import itertools

import pytest
import torch

from mindspeed_laga import count_bytes
from mindspeed_laga.cp_algos import ALGOS
from mindspeed_laga.tools.spawn import run_on_ranks
from support import case_runs
from support.variants import CPU_KERNELS, algos_for
from support.key_padding import FORMS_BY_NAME as FORMS
from support.key_padding import (SCALE, assemble, full_inputs, local_inputs, padding_mask,
                                 reference, run_case, worker)

LAGA_OPTIONS = [{}, {"trim_causal_prefix": True},
                {"recompute_kv": True, "kv_block_size": 5, "trim_causal_prefix": True}]


def cases_for(cp):
    out = []
    for form, algo, lay, side, kernel in itertools.product(
            FORMS, algos_for(cp), ("contiguous", "zigzag"), ("right", "left"), CPU_KERNELS):
        # layouts x kernels at every form would repeat the same code paths: the layout is
        # crossed with the form, the kernel with the padding side
        if (lay == "zigzag") != (kernel == "sdpa") and side == "right":
            continue
        for opts in LAGA_OPTIONS if form == "laga" else [{}]:
            out.append(dict(form=form, cp_algo=algo, layout=lay, side=side, kernel=kernel,
                            causal=True, empty_rows="mean", options=opts))
    # empty rows "zero", causal=False, the overlapped gather: one sweep over the forms each
    for form in FORMS:
        for opts in LAGA_OPTIONS[::2] if form == "laga" else [{}]:
            out.append(dict(form=form, cp_algo="ulysses", layout="contiguous", side="left",
                            kernel="sdpa", causal=True, empty_rows="zero", options=opts))
            out.append(dict(form=form, cp_algo="allgather", layout="zigzag", side="right",
                            kernel="eager", causal=False, empty_rows="mean", options=opts))
    if cp > 1:
        out.append(dict(form="laga", cp_algo="allgather", layout="zigzag", side="left",
                        kernel="sdpa", causal=True, empty_rows="mean",
                        options={"overlap": True, "trim_causal_prefix": True}))
    return out


results = case_runs.ResultsByCP(cases_for, run_case, worker)


def case_id(case):
    return case_runs.case_id(case, "form", "cp_algo", "layout", "side", "causal", "kernel",
                             "empty_rows")


def compared(cp):
    refs = {}
    for case, per_rank in results(cp):
        key = (case["side"], case["causal"], case["empty_rows"])
        if key not in refs:
            refs[key] = reference(padding_mask(case["side"]), case["causal"], case["empty_rows"])
        ulysses_degree = 2 if ALGOS[case["cp_algo"]].takes_ulysses_degree else 1
        yield case_id(case), assemble(per_rank, case["layout"], cp, ulysses_degree), refs[key]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_key_padding_matches_reference(cp):
    case_runs.assert_all_match(compared(cp), tolerance=1e-10)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cp", [2])
def test_key_padding_moves_no_extra_bytes(cp):
    """LAGA stays latent-only: the padded call moves exactly the bytes of the plain one."""
    padded = {}
    for case, per_rank in results(cp):
        if case["form"] == "laga" and not case["options"] and case["causal"]:
            padded[(case["cp_algo"], case["layout"])] = per_rank[0]["bytes"]
    plain = run_on_ranks(_plain_bytes_worker, cp, sorted(padded), timeout_s=300)[0]
    for key, got in zip(sorted(padded), plain):
        assert padded[key] == got, key


def _plain_bytes_worker(rank, cp, keys):
    import torch.distributed as dist
    x = full_inputs()
    out = []
    for algo, lay in keys:
        inputs, _ = local_inputs(x, lay, cp, rank)
        weight = x["kv_up_weight"].clone().requires_grad_()
        with count_bytes() as counter:
            y = FORMS["laga"](*inputs.values(), weight, softmax_scale=SCALE,
                              cp_group=dist.group.WORLD, cp_algo=algo, layout=lay)
            y.backward(torch.ones_like(y))
        out.append(counter.bytes())
    return out

"""Packed documents (``cu_seqlens``): every form, algo, layout and LAGA option on 1, 2
and 4 gloo ranks against a float64 single-process attention (tests/support/documents.py).

The reference knows nothing of segments, windows or pieces: it builds the
[S, S] document mask from each position's document id and runs plain softmax
attention over the full sequence. All cases of one CP size run in one spawned
job; pytest then checks each case.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from mindspeed_laga import count_bytes
from mindspeed_laga import layout as layouts
from mindspeed_laga.tools.spawn import run_on_ranks
from support import case_runs
from support.variants import CPU_KERNELS
from support.documents import (FORMS, SCALE, algos_and_layouts, compared, doc_zigzag_ok,
                               document_sets, full_inputs)

LAGA_OPTIONS = [{}, {"trim_causal_prefix": True}, {"recompute_kv": True},
                {"recompute_kv": True, "kv_block_size": 5, "trim_causal_prefix": True}]


def cases_for(cp):
    out = []
    docs = document_sets(cp)
    for form, algo, lay, (doc_name, bounds), causal in itertools.product(
            FORMS, *algos_and_layouts(cp), docs.items(),
            (True, False)):
        if lay == "doc_zigzag" and not doc_zigzag_ok(bounds, cp):
            continue
        if not causal and doc_name not in ("ragged", "ragged_2p", "short"):
            continue
        options = LAGA_OPTIONS if form == "laga" else [{}]
        for opts in options:
            for kernel in CPU_KERNELS:
                out.append(dict(form=form, cp_algo=algo, layout=lay, docs=doc_name, bounds=bounds,
                                causal=causal, kernel=kernel, options=opts))
    return out


def run_case(rank, cp, case, group):
    x = full_inputs()
    bounds = case["bounds"]

    def local(t):
        return layouts.shard(t, case["layout"], cp, rank, cu_seqlens=bounds) if cp > 1 else t

    inputs = {k: local(x[k]).clone().requires_grad_() for k in ("query", "kv_latent", "k_pos_emb")}
    weight = x["kv_up_weight"].clone().requires_grad_()
    # A torch tensor on even ranks and a list on odd ones: both are accepted.
    cu = torch.tensor(bounds, dtype=torch.int32) if rank % 2 == 0 else list(bounds)
    with count_bytes() as counter:
        out = FORMS[case["form"]](inputs["query"], inputs["kv_latent"], inputs["k_pos_emb"], weight,
                                  softmax_scale=SCALE, cp_group=group, cp_algo=case["cp_algo"],
                                  layout=case["layout"], causal=case["causal"], kernel=case["kernel"],
                                  cu_seqlens=cu, **case["options"])
        out.backward(local(x["grad_out"]))
    grads = {k: v.grad for k, v in inputs.items()}
    grads["kv_up_weight"] = weight.grad
    return {"out": out.detach(), "grads": grads, "bytes": counter.bytes()}


def worker(rank, cp, cases):
    import torch.distributed as dist
    return [run_case(rank, cp, case, dist.group.WORLD) for case in cases]


results = case_runs.ResultsByCP(cases_for, run_case, worker)


def case_id(case):
    return case_runs.case_id(case, "form", "cp_algo", "layout", "docs", "causal", "kernel")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_documents_match_reference(cp):
    case_runs.assert_all_match(compared(results(cp), cp, case_id), tolerance=1e-10)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cp", [2, 4])
def test_documents_do_not_change_collective_bytes(cp):
    """The same call without cu_seqlens moves exactly the same bytes."""
    by_key = {}
    for case, per_rank in results(cp):
        key = (case["form"], case["cp_algo"], case["kernel"], tuple(case["options"].items()))
        by_key.setdefault(key, set()).add(per_rank[0]["bytes"])
    plain = run_on_ranks(_plain_bytes_worker, cp, sorted(by_key), timeout_s=300)[0]
    for key, got in zip(sorted(by_key), plain):
        assert by_key[key] == {got}, key


def _plain_bytes_worker(rank, cp, keys):
    import torch.distributed as dist
    x = full_inputs()
    out = []
    for form, algo, kernel, options in keys:
        inputs = [layouts.shard(x[k], "zigzag", cp, rank).requires_grad_()
                  for k in ("query", "kv_latent", "k_pos_emb")]
        weight = x["kv_up_weight"].clone().requires_grad_()
        with count_bytes() as counter:
            y = FORMS[form](*inputs, weight, softmax_scale=SCALE, cp_group=dist.group.WORLD,
                            cp_algo=algo, layout="zigzag", kernel=kernel, **dict(options))
            y.backward(torch.ones_like(y))
        out.append(counter.bytes())
    return out

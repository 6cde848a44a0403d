"""Packed documents (``cu_seqlens``) on kernel="npu" through the CPU stand-in torch_npu:
every form, both CP algos, the three layouts, LAGA's options, causal and not, on 1, 2
and 4 gloo ranks, outputs and all four grads against a float64 attention written
here (the [S, S] document mask built from each position's document id).

The stand-in's call record shows how the documents reached the op: layout TND
with cumulative lengths, no mask but the compressed 2048x2048 one, and a number
of calls per forward that does not depend on how many documents there are (one
per query segment for the segment kernel; at most two per (key block, segment)
for the blockwise kernel), where one call per document would exceed it.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from mindspeed_laga import layout as layouts
from mindspeed_laga.tools.spawn import run_on_ranks

from support import case_runs, fake_torch_npu
from support.documents import (FORMS, S, SCALE, algos_and_layouts, compared, doc_zigzag_ok,
                               document_sets, full_inputs)

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

LAGA_OPTIONS = [{}, {"trim_causal_prefix": True}, {"recompute_kv": True},
                {"recompute_kv": True, "kv_block_size": 5, "trim_causal_prefix": True},
                {"recompute_kv": True, "kv_block_size": 7, "pad_v": True}]
TOLERANCE = 2e-5  # float32 kernel against the float64 reference, relative to the largest value


def cases_for(cp):
    out = []
    for form, algo, lay, (doc_name, bounds), causal in itertools.product(
            FORMS, *algos_and_layouts(cp),
            document_sets(cp).items(), (True, False)):
        if lay == "doc_zigzag" and not doc_zigzag_ok(bounds, cp):
            continue
        if not causal and doc_name not in ("ragged", "short"):
            continue
        for opts in (LAGA_OPTIONS if form == "laga" else [{}]):
            out.append(dict(form=form, cp_algo=algo, layout=lay, docs=doc_name, bounds=bounds,
                            causal=causal, options=opts))
    return out


def count_cases(cp):
    """1 vs 8 documents and many short ones, same S: forward calls are counted."""
    docs = {"one": [0, S], "eight": list(range(0, S + 1, S // 8)),
            "short": list(range(0, S + 1, 2 * cp))}
    out = []
    for (name, bounds), opts in itertools.product(
            docs.items(), ({}, {"recompute_kv": True, "kv_block_size": 8})):
        out.append(dict(form="laga", cp_algo="allgather", layout="zigzag", docs=name,
                        bounds=bounds, causal=True, options=opts, counted=True))
    return out


def run_case(rank, cp, case, group, module):
    x = {k: v.float() for k, v in full_inputs().items()}
    bounds = case["bounds"]

    def local(t):
        return layouts.shard(t, case["layout"], cp, rank, cu_seqlens=bounds) if cp > 1 else t

    inputs = {k: local(x[k]).clone().requires_grad_() for k in ("query", "kv_latent", "k_pos_emb")}
    weight = x["kv_up_weight"].clone().requires_grad_()
    module.reset_calls()
    out = FORMS[case["form"]](inputs["query"], inputs["kv_latent"], inputs["k_pos_emb"], weight,
                              softmax_scale=SCALE, cp_group=group, cp_algo=case["cp_algo"],
                              layout=case["layout"], causal=case["causal"], kernel="npu",
                              cu_seqlens=list(bounds), **case["options"])
    forward_calls = [dict(c) for c in module.calls]
    module.reset_calls()
    out.backward(local(x["grad_out"]))
    grads = {k: v.grad for k, v in inputs.items()}
    grads["kv_up_weight"] = weight.grad
    calls = forward_calls + module.calls
    return {"out": out.detach(), "grads": grads, "calls": calls,
            "forward_calls": len(forward_calls),
            "largest_mask": max([_elements(c["atten_mask_shape"]) for c in calls] + [0])}


def _elements(shape):
    n = 1
    for s in shape or (0,):
        n *= s
    return n


def worker(rank, cp, cases):
    import torch.distributed as dist
    module = fake_torch_npu.install()
    group = dist.group.WORLD if cp > 1 else None
    return [run_case(rank, cp, case, group, module) for case in cases]


_RESULTS = {}


def results(cp):
    """All cases of one CP size in one spawned job (bounded: a hang fails)."""
    if cp not in _RESULTS:
        cases = cases_for(cp) + count_cases(cp)
        if cp == 1:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # as spawned ranks run: tiny ops, a shared machine
            try:
                per_rank = [worker(0, 1, cases)]
            finally:
                torch.set_num_threads(threads)
        else:
            per_rank = run_on_ranks(worker, cp, cases, timeout_s=600)
        _RESULTS[cp] = [(c, [per_rank[r][i] for r in range(cp)]) for i, c in enumerate(cases)]
    return _RESULTS[cp]


def case_id(case):
    return case_runs.case_id(case, "form", "cp_algo", "layout", "docs", "causal")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_npu_documents_match_reference(cp):
    case_runs.assert_all_match(compared(results(cp), cp, case_id), tolerance=TOLERANCE,
                               error=_relative)


def _relative(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def segment_length(layout, cp):
    """Rows of one query segment: contiguous S/P, zigzag S/2P; doc_zigzag cuts per document."""
    if cp == 1:
        return S
    return {"contiguous": S // cp, "zigzag": S // (2 * cp), "doc_zigzag": 0}[layout]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_npu_documents_use_tnd_and_small_masks(cp):
    blockwise_causal_tnd = set()  # sparse modes of the blockwise kernel's packed causal calls
    for case, per_rank in results(cp):
        for r in per_rank:
            layouts_used = {c["input_layout"] for c in r["calls"]}
            names = {c["name"] for c in r["calls"]}
            assert "npu_fusion_attention" in names, case_id(case)  # the stand-in really ran
            if case["options"].get("recompute_kv"):
                assert "npu_fusion_attention_grad" in names, case_id(case)
            assert r["largest_mask"] <= 2048 * 2048, case_id(case)
            blockwise = case["options"].get("recompute_kv", False)
            # The segment kernel packs every segment's pieces; the block kernel packs when a
            # segment meets several documents in one block: always with the short ones
            # (length 2P) when a segment is longer than them (doc_zigzag segments never
            # cross a document boundary).
            packs = case["docs"] == "short" and segment_length(case["layout"], cp) > 2 * cp
            if packs or (case["docs"] != "one" and not blockwise):
                assert "TND" in layouts_used, (case_id(case), layouts_used)
            # causal: mode 3 for causal pieces (and mode 0 for the blockwise kernel's
            # fully visible parts); without causal every piece sees all of its keys
            tnd = [c for c in r["calls"] if c["input_layout"] == "TND"]
            modes = {c["sparse_mode"] for c in tnd}
            allowed = ({0, 3} if blockwise else {3}) if case["causal"] else {0}
            assert modes <= allowed, (case_id(case), modes)
            if blockwise and case["causal"]:
                # a tile's runs may all be past their diagonal (mode 0 only); some tile
                # of some case packs causal parts
                blockwise_causal_tnd |= modes
            else:
                assert not (tnd and case["causal"]) or 3 in modes, case_id(case)
            assert all(len(c["actual_seq_qlen"]) == len(c["actual_seq_kvlen"]) for c in tnd)
    assert 3 in blockwise_causal_tnd, blockwise_causal_tnd


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_npu_calls_do_not_grow_with_documents(cp):
    """Forward calls per rank: the segment kernel makes one per query segment, the
    blockwise one at most two per (key block, segment), for 1, 8 or S/2P documents;
    one call per document would exceed that bound for the many-document cases."""
    segments = 2 if cp > 1 else 1  # zigzag: two chunks per rank
    counted = [(c, r) for c, r in results(cp) if c.get("counted")]
    assert len(counted) == 6
    calls = {}
    for case, per_rank in counted:
        block = case["options"].get("kv_block_size")
        bound = 2 * -(-S // block) * segments if block else segments
        for rank, r in enumerate(per_rank):
            assert r["forward_calls"] <= bound, (case_id(case), r["forward_calls"], bound)
            calls[(case["docs"], block, rank)] = r["forward_calls"]
        if case["docs"] == "short" and cp == 1:
            # a call per document would already exceed the bound
            assert len(case["bounds"]) - 1 > bound, (case["bounds"], bound)
    for block, rank in {(b, r) for _, b, r in calls}:
        assert calls[("eight", block, rank)] == calls[("short", block, rank)], calls

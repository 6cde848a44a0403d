"""Steady state through the core API: per call, one gather forward, one reduce-scatter
backward, nothing else, and no host read.

On 2 gloo ranks, each case opens ``MICRO_BATCHES`` micro-batches with ``new_micro_batch``
and makes ``CALLS`` calls in each (forward, then backward), counted call by call with the
collective counter and the host-sync counter (tests/support/collectives.py, host_syncs.py):

- the first call of a micro-batch exchanges the ranks' agreement once: one small int64
  all-reduce, before its one data all-gather;
- every later call of the micro-batch: exactly one data all-gather forward (the latent, or
  sparse MLA's packed ``[latent | rope | index key]``), one reduce-scatter backward
  (under ``torch.utils.checkpoint``, the recompute's all-gather too, in backward), no
  other collective, and zero host syncs, forward and backward;
- every call's output and grads match the float64 single-process references of the other
  tests (tests/support/key_padding.py, documents.py, sparse_mla.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as checkpoint

from mindspeed_laga import layout as layouts
from mindspeed_laga.tools.spawn import run_on_ranks
from support import case_runs
from support import documents as docs
from support import key_padding as kp
from support import sparse_mla as sp
from support.collectives import count_collectives
from support.host_syncs import count_host_syncs

CP, MICRO_BATCHES, CALLS = 2, 2, 3
LAYOUT = "zigzag"
DOCUMENTS = [0, 5, 19, 32]  # ragged, crossing the rank boundary (documents.S = 32)

CASES = {
    "plain": dict(form="laga"),
    "key-padding-left": dict(form="laga", side="left"),
    "key-padding-right": dict(form="laga", side="right", options={"trim_causal_prefix": True}),
    "documents": dict(form="laga", documents=True),
    "recompute-kv": dict(form="laga", options={"recompute_kv": True, "kv_block_size": 5}),
    "overlap": dict(form="laga", overlap=True),
    "overlap-key-padding": dict(form="laga", overlap=True, side="right"),
    "checkpoint": dict(form="laga", checkpoint=False),
    "checkpoint-reentrant": dict(form="laga", checkpoint=True),
    "sparse": dict(form="sparse"),
    "sparse-documents": dict(form="sparse", documents=True),
}
# sparse MLA's packed documents: ragged, inside the layout's chunks (sparse_mla.S = 16)
SPARSE_DOCUMENTS = [0, 3, 9, 16]


def _protocol():
    """The agreement protocol's entry point; AttributeError (naming it) until it exists."""
    import mindspeed_laga
    return mindspeed_laga.new_micro_batch


# --- spawned ranks --------------------------------------------------------------------------

def _dense_inputs(case, rank):
    """(full float64 inputs, this rank's leaf tensors, the weight, shard function, kwargs)."""
    if case.get("documents"):
        x = docs.full_inputs()

        def local(t):
            return layouts.shard(t, LAYOUT, CP, rank, cu_seqlens=DOCUMENTS)
        extra = dict(cu_seqlens=DOCUMENTS)
    else:
        x = kp.full_inputs()

        def local(t):
            return layouts.shard(t, LAYOUT, CP, rank)
        extra = {}
        if case.get("side"):
            extra["key_padding_mask"] = kp.padding_mask(case["side"])
    inputs = {k: local(x[k]).clone().requires_grad_() for k in ("query", "kv_latent", "k_pos_emb")}
    inputs["kv_up_weight"] = x["kv_up_weight"].clone().requires_grad_()
    return x, inputs, local, extra


def _dense_call(case, inputs, extra, group):
    """One LAGA call (``start_latent_gather`` first when overlapped); its output."""
    from mindspeed_laga import laga_attention, start_latent_gather

    def call(query, kv_latent, k_pos_emb, weight):
        kwargs = dict(extra, **case.get("options", {}))
        if case.get("overlap"):
            kwargs["latent_gather"] = start_latent_gather(kv_latent, k_pos_emb, cp_group=group)
        return laga_attention(query, kv_latent, k_pos_emb, weight, softmax_scale=kp.SCALE,
                              cp_group=group, layout=LAYOUT, kernel="eager", **kwargs)

    tensors = [inputs[k] for k in ("query", "kv_latent", "k_pos_emb", "kv_up_weight")]
    if "checkpoint" in case:
        return checkpoint.checkpoint(call, *tensors, use_reentrant=case["checkpoint"])
    return call(*tensors)


def _sparse_inputs(case):
    """sparse_mla's float64 inputs: one packed sequence when the case has documents."""
    return sp.full_inputs(dims={"B": 1} if case.get("documents") else None)


def _sparse_call(case, inputs, group):
    from mindspeed_laga import sparse_laga_attention
    local = [inputs[k] for k in sp.LOCAL]
    d_r = inputs["k_pos_emb"].shape[-1]
    got = sparse_laga_attention(*local[:3], inputs["kv_up_weight"], *local[3:],
                                index_topk=sp.TOPK, softmax_scale=sp.SCALE,
                                qk_head_dim=inputs["query"].shape[-1] - d_r, v_head_dim=sp.D_V,
                                cp_group=group, layout=LAYOUT, indexer_loss_coeff=sp.COEFF,
                                cu_seqlens=SPARSE_DOCUMENTS if case.get("documents") else None)
    return got


def _one_call(case, rank, group):
    """One forward + backward on fresh leaves, counted; (counts, output, grads)."""
    with count_host_syncs() as syncs, count_collectives(regions=syncs) as calls:
        if case["form"] == "sparse":
            x = _sparse_inputs(case)
            inputs = {k: layouts.shard(x[k], LAYOUT, CP, rank).clone().requires_grad_()
                      for k in sp.LOCAL}
            inputs["kv_up_weight"] = x["kv_up_weight"].clone().requires_grad_()
            with syncs.region("forward"):
                got = _sparse_call(case, inputs, group)
            with syncs.region("backward"):
                grad_out = layouts.shard(x["grad_out"], LAYOUT, CP, rank)
                ((got.output * grad_out).sum() + got.indexer_loss / CP).backward()
            out = dict(output=got.output.detach(), topk_indices=got.topk_indices,
                       loss=got.indexer_loss.detach())
        else:
            x, inputs, local, extra = _dense_inputs(case, rank)
            with syncs.region("forward"):
                result = _dense_call(case, inputs, extra, group)
            with syncs.region("backward"):
                result.backward(local(x["grad_out"]))
            out = dict(out=result.detach())
    counts = {phase: dict(collectives=[(c.kind, str(c.dtype).replace("torch.", ""), c.backward)
                                       for c in calls.select(phase)],
                          syncs=syncs.by_op(phase), payload=[c.payload for c in calls.select(phase)])
              for phase in ("forward", "backward")}
    counts["outside"] = dict(collectives=[c.name for c in calls.select(None)],
                             syncs=syncs.by_op(None))
    out["grads"] = {k: v.grad for k, v in inputs.items()}
    return counts, out


def worker(rank, world_size, names):
    new_micro_batch = _protocol()
    group = dist.group.WORLD
    results = {}
    for name in names:
        runs = results[name] = []
        for micro_batch in range(MICRO_BATCHES):
            new_micro_batch(group)
            for call in range(CALLS):
                counts, out = _one_call(CASES[name], rank, group)
                runs.append(dict(micro_batch=micro_batch, call=call, counts=counts, **out))
    return results


# --- the tests ------------------------------------------------------------------------------

_RESULTS = {}


def _results():
    """Every case's per-rank results, from one spawn; a failed spawn fails every test with
    its error, without spawning again."""
    if not _RESULTS:
        try:
            _protocol()  # fail here, clearly, before spawning ranks that would fail alike
            _RESULTS["ranks"] = run_on_ranks(worker, CP, list(CASES), timeout_s=600)
        except Exception as exc:  # noqa: BLE001  (kept, re-raised by every test)
            _RESULTS["error"] = exc
    if "error" in _RESULTS:
        raise _RESULTS["error"]
    return _RESULTS["ranks"]


def _expected(case, first: bool):
    """Per phase, the collectives of one call: (kind, dtype, issued in backward)."""
    data = "float64"
    forward = ([("all_reduce", "int64", False)] if first else []) + [("all_gather", data, False)]
    backward = [("reduce_scatter", data, True)]
    if "checkpoint" in case:  # the recompute gathers again, inside backward, exchanging nothing
        backward = [("all_gather", data, True)] + backward
    return forward, backward


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(CASES))
def test_steady_state_collectives_and_host_syncs(name):
    case = CASES[name]
    for rank, per_case in enumerate(_results()):
        for run in per_case[name]:
            where = f"rank {rank}, micro-batch {run['micro_batch']}, call {run['call']}"
            counts = run["counts"]
            forward, backward = _expected(case, first=run["call"] == 0)
            assert counts["forward"]["collectives"] == forward, (where, counts)
            assert counts["backward"]["collectives"] == backward, (where, counts)
            assert counts["outside"]["collectives"] == [], (where, counts)
            if run["call"] > 0:  # steady state: no host read at all
                assert counts["forward"]["syncs"] == {}, (where, counts)
                assert counts["backward"]["syncs"] == {}, (where, counts)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(CASES))
def test_steady_state_data_moves_the_latent_only(name):
    """The data all-gather forward and the reduce-scatter backward move this rank's latent
    (sparse: latent, rope and index key), the same bytes each way, every call; a later
    call's gather adds the in-band check's two int64 values per rank (agreement/inband.py)."""
    from mindspeed_laga.agreement.inband import BAND
    case = CASES[name]
    sizes = sp if case["form"] == "sparse" else (docs if case.get("documents") else kp)
    batch = 1 if case.get("documents") else sizes.B
    width = sizes.D_C + sizes.D_R + (sp.INDEX_DIM if case["form"] == "sparse" else 0)
    latent = sizes.S // CP * batch * width * 8
    for per_case in _results():
        for run in per_case[name]:
            if run["call"] == 0:
                continue
            assert run["counts"]["forward"]["payload"] == [latent + BAND * 8]
            assert run["counts"]["backward"]["payload"][-1] == latent


# sparse MLA: the attention runs in float64, the indexer's products and its loss in float32
SPARSE_ATOL = {"index_query": 1e-6, "index_key": 1e-6, "index_weights": 1e-6, "loss": 1e-6}


def _sparse_close(where, got, want):
    assert torch.equal(got["topk_indices"], want["topk_indices"]), where
    pairs = [("output", got["output"], want["output"]), ("loss", got["loss"], want["loss"])]
    pairs += [(k, got["grads"][k], v) for k, v in want["grads"].items()]
    for name, a, b in pairs:
        scale = max(1.0, b.abs().max().item())
        err = (a - b).abs().max().item()
        assert err <= SPARSE_ATOL.get(name, 1e-10) * scale, (where, name, err)


def _dense_reference(case):
    if case.get("documents"):
        return docs.reference(DOCUMENTS, True)
    return kp.reference(kp.padding_mask(case.get("side") or "none"))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(CASES))
def test_every_call_matches_the_single_process_reference(name):
    case = CASES[name]
    per_rank = [per_case[name] for per_case in _results()]
    if case["form"] == "sparse":
        want = sp.reference(_sparse_inputs(case),
                            documents=SPARSE_DOCUMENTS if case.get("documents") else None)
        for index in range(MICRO_BATCHES * CALLS):
            got = sp.assemble([[runs[index]] for runs in per_rank], 0, LAYOUT)
            _sparse_close(f"call {index}", got, want)
        return
    ref = _dense_reference(case)
    for index in range(MICRO_BATCHES * CALLS):
        runs = [dict(out=r[index]["out"], grads=r[index]["grads"]) for r in per_rank]
        if case.get("documents"):
            got = docs.assemble(runs, dict(layout=LAYOUT, bounds=DOCUMENTS), CP)
        else:
            got = kp.assemble(runs, LAYOUT, CP)
        case_runs.assert_all_match([(f"call {index}", got, ref)], tolerance=1e-10)

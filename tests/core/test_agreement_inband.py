"""A later call's in-band check on two gloo ranks: no abort, no silent wrong number.

A later call of a micro-batch exchanges nothing before its latent all-gather; the gather
carries each rank's code of the call (its row, its place, its weight and a linear's
``agreement_tensors``) and its verdict, compared on the device (agreement/inband.py). Each
scenario is a micro-batch of layer calls, then ``settle()``, all in one spawned job bounded
by its timeout. Every call that must be right is compared with a float64 single-process
reference (support/key_padding.py), which knows nothing of the protocol; every call that
mixed ranks' data must be NaN on every rank; every rank must raise naming the cause.
"""
from __future__ import annotations

import pytest
import torch

from mindspeed_laga import (agreement, laga_attention, new_micro_batch, settle,
                            start_latent_gather)
from mindspeed_laga.tools.spawn import run_on_ranks
from support.key_padding import SCALE, assemble, full_inputs, local_inputs, padding_mask, reference

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)


def _call(rank, seed=0, backward=True, cast=None, drop=0, linear=None, overlap=False,
          frozen=False, group=None, **kw):
    """One layer call of layer ``seed`` on this rank's shard: its output and grads
    (``overlap``: the latent gathered by start_latent_gather first; ``frozen``: the latent
    and its rope key need no grad)."""
    import torch.distributed as dist
    group = group or dist.group.WORLD
    x = full_inputs(seed)
    inputs, local = local_inputs(x, "zigzag", 2, rank)
    leaves = [t.detach()[:t.shape[0] - drop].clone() for t in inputs.values()]
    weight = x["kv_up_weight"].clone()
    if cast is not None:
        leaves, weight = [t.to(cast) for t in leaves], weight.to(cast)
    leaves = [t.requires_grad_(not (frozen and i in (1, 2))) for i, t in enumerate(leaves)]
    weight.requires_grad_()
    if overlap:
        kw["latent_gather"] = start_latent_gather(leaves[1], leaves[2], cp_group=group)
    out = laga_attention(*leaves, weight, softmax_scale=SCALE, cp_group=group,
                         kv_up_linear=linear, **kw)
    if not backward:
        return {"out": out.detach()}
    out.backward(local(x["grad_out"]))
    grads = dict(zip(("query", "kv_latent", "k_pos_emb"), (t.grad for t in leaves)))
    grads["kv_up_weight"] = weight.grad
    return {"out": out.detach(), "grads": grads}


def _one_rank_raises(rank, overlap=False, **wrong):
    """Call 2 differs on rank 1 only, forward-only (rank 1 raises there; rank 0 goes on)."""
    calls = [_call(rank, backward=False, overlap=overlap)]
    try:
        calls.append(_call(rank, backward=False, overlap=overlap,
                           **(wrong if rank == 1 else {})))
    except ValueError as exc:
        calls.append(str(exc))
    return calls


def later_dtype(rank):
    return _one_rank_raises(rank, cast=torch.float32)


def later_length(rank):
    return _one_rank_raises(rank, drop=2)


def overlapped_length(rank):
    return _one_rank_raises(rank, drop=2, overlap=True)


def later_local_failure(rank):
    return _one_rank_raises(rank, layout="no-such-layout")


def later_check_ranks(rank):
    return [_call(rank), _call(rank, check_ranks=(None, False)[rank]), _call(rank)]


def later_no_grad(rank):
    """Call 2's latent needs no grad on rank 1 only: it still joins the reduce-scatter."""
    return [_call(rank), _call(rank, frozen=rank == 1), _call(rank)]


def layer_mixup(rank):
    """Layers 0, 1, 2 on rank 0; rank 1 repeats layer 2 in place of layer 1."""
    return [_call(rank, seed=seed) for seed in ((0, 1, 2), (0, 2, 2))[rank]]


class _ScaledLinear:
    """A kv_up_linear with a scale tensor (an FP8 hook's scales, in small)."""

    agreement_code = 7

    def __init__(self, scale):
        self.scale = torch.tensor([scale], dtype=torch.float64)

    def __call__(self, latent, rows, first_row):
        return torch.nn.functional.linear(latent, rows) * self.scale

    def agreement_tensors(self):
        return [self.scale]


def scales_off(rank):
    """Call 2's linear scale is 1% off on rank 1: its row is alike, its scales are not."""
    return [_call(rank, linear=_ScaledLinear(1.0)),
            _call(rank, linear=_ScaledLinear((1.0, 1.01)[rank]))]


SCENARIOS = {  # name -> what every rank's error names
    "later_dtype": "latent's dtype in a later call",
    "later_length": "latent's shape [s, b, d]",
    "overlapped_length": "latent's shape [s, b, d]",
    "later_local_failure": "no-such-layout",
    "later_check_ranks": "check_ranks in a later call (call 2 of the micro-batch)",
    "later_no_grad": "which inputs need grads (requires_grad under grad mode) in a later call "
                     "(call 2 of the micro-batch)",
    "layer_mixup": "later calls differ: the latent gathered in a later call differed in band",
    "scales_off": "later calls differ: the latent gathered in a later call differed in band",
}


def _worker(rank, world):
    import torch.distributed as dist
    reports = {}
    for name in SCENARIOS:
        agreement.reset()
        dist.barrier()
        new_micro_batch(dist.group.WORLD)
        calls = globals()[name](rank)
        try:
            settle()
            error = None
        except ValueError as exc:
            error = str(exc)
        reports[name] = (calls, error)
    return reports


@pytest.fixture(scope="module")
def reports():
    return run_on_ranks(_worker, 2, timeout_s=120)


def _right(calls_by_rank, call, seed=0):
    """Call ``call`` on both ranks equals the float64 reference of layer ``seed``."""
    parts = [calls[call] for calls in calls_by_rank]
    expected, expected_grads = reference(padding_mask("none"), seed=seed)
    if "grads" not in parts[0]:
        out = _unshard([p["out"] for p in parts])
        return torch.allclose(out, expected, atol=1e-12, rtol=0)
    out, grads = assemble(parts, "zigzag", 2)
    return torch.allclose(out, expected, atol=1e-12, rtol=0) and all(
        torch.allclose(grads[k], v, atol=1e-10, rtol=0) for k, v in expected_grads.items())


def _unshard(parts):
    from mindspeed_laga import layout
    return layout.unshard(parts, "zigzag")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_rank_names_the_later_difference(reports, name):
    for rank, report in enumerate(reports):
        error = report[name][1]
        assert error and SCENARIOS[name] in error, (rank, error)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", ["later_dtype", "later_length", "overlapped_length",
                                  "later_local_failure"])
def test_a_rank_that_knows_its_call_is_wrong_still_joins_it(reports, name):
    """Rank 1 raises in call 2 naming it; rank 0's call 2 returned (no abort, no wait) NaN."""
    (calls0, _), (calls1, _) = reports[0][name], reports[1][name]
    assert _right([calls0, calls1], 0)
    assert isinstance(calls1[1], str) and SCENARIOS[name] in calls1[1], calls1[1]
    assert torch.isnan(calls0[1]["out"]).all()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name,mixed,right", [("later_check_ranks", 1, {0: 0, 2: 0}),
                                              ("layer_mixup", 1, {0: 0, 2: 2}),
                                              ("later_no_grad", 1, {0: 0, 2: 0}),
                                              ("scales_off", 1, {0: 0})])
def test_a_mixed_call_is_nan_on_every_rank_and_the_others_exact(reports, name, mixed, right):
    per_rank = [report[name][0] for report in reports]
    for calls in per_rank:
        assert torch.isnan(calls[mixed]["out"]).all()
        assert torch.isnan(calls[mixed]["grads"]["kv_up_weight"]).all()
    for call, seed in right.items():
        assert _right(per_rank, call, seed), (name, call)


def test_the_fp8_hook_hands_its_held_scales_to_the_in_band_code():
    """Delayed scaling holds the latent's and the weight's scales between calls: the hook's
    ``agreement_tensors`` hands them (the gradient's, which follows each rank's own
    queries, is left out); block and MX scaling hold none."""
    from types import SimpleNamespace as NS

    from patches.mindspeed_llm.fp8 import held_scales
    keys = ("inputs", "weight", "grads")
    scales = {key: torch.full((1,), float(i)) for i, key in enumerate(keys)}
    meta = NS(**{key: NS(scale=NS(scale=t)) for key, t in scales.items()})
    assert [id(t) for t in held_scales(meta)] == [id(scales["inputs"]), id(scales["weight"])]
    assert held_scales(NS(inputs=NS(), weight=None, grads=None)) == []


def _skipping_worker(rank, world):
    """Rank 1 skips layer 1 (layers 0, 1, 2 on rank 0), on a group whose backend times out
    after 5 s: what each rank's calls and settle gave."""
    from datetime import timedelta

    import torch.distributed as dist
    group = dist.new_group([0, 1], timeout=timedelta(seconds=5))
    new_micro_batch(group)
    calls = []
    try:
        for seed in ((0, 1, 2), (0, 2))[rank]:
            calls.append(_call(rank, seed=seed, group=group))
        settle(group)
    except RuntimeError as exc:
        calls.append(str(exc))
    return calls


@pytest.mark.timeout(150)
def test_a_skipped_layer_mixes_nothing_and_ends_named_at_the_backend_timeout():
    """The skipped layer's neighbours meet in one gather: NaN on both ranks (no silent mix
    of layers); then rank 0 gathers where rank 1 settles, and both raise at the backend's
    timeout naming what makes a rank miss a collective (no abort, no unnamed wait)."""
    per_rank = run_on_ranks(_skipping_worker, 2, timeout_s=120)
    assert _right(per_rank, 0)
    for calls in per_rank:
        assert torch.isnan(calls[1]["out"]).all()
        assert isinstance(calls[-1], str) and "skipped or repeated a LAGA layer" in calls[-1], \
            calls[-1]


def test_flags_past_the_bound_are_folded_keeping_every_bit(monkeypatch):
    """The flags a micro-batch's later calls note are kept as they are and folded into
    bits at the exchange; past ROWS_KEPT of them they fold early, losing none: a wrong
    latent noted first still sets its bit after many right calls, and nothing else does."""
    from mindspeed_laga import comm
    from mindspeed_laga.agreement import schedule
    from mindspeed_laga.agreement.fields import FLAGS

    class Group:  # stands for a process group of 2 (the schedule keys state weakly by it)
        pass

    group = Group()
    monkeypatch.setattr(comm, "group_size", lambda g: 2)
    schedule.flag(group, "latent", torch.tensor(True))
    for _ in range(3 * schedule.ROWS_KEPT):
        schedule.flag(group, "topk_indices", torch.tensor(False))
    state = schedule.state(group)
    assert len(state.flagged) <= schedule.ROWS_KEPT
    bits = int(schedule._flags(state))
    assert bits == 1 << list(FLAGS).index("latent")

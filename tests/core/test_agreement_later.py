"""Later calls of a micro-batch on two gloo ranks: every difference named, no false stop.

A micro-batch's first call exchanges its row; the later calls exchange nothing and record
theirs, in order, for the next exchange or settle. Each scenario below is a micro-batch of
three layer calls, then ``settle()``; all run in one spawned job (bounded by its timeout),
and every output is compared with a float64 single-process reference
(support/key_padding.py), which knows nothing of the protocol.
"""
from __future__ import annotations

import gc

import pytest
import torch

from mindspeed_laga import agreement, laga_attention, new_micro_batch, settle
from mindspeed_laga.tools.spawn import run_on_ranks
from support.key_padding import (SCALE, assemble, full_inputs, local_inputs, padding_mask,
                                 reference)

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)


def _layer(rank, **kw):
    """One layer call, forward and backward, on this rank's shard: its output and grads."""
    import torch.distributed as dist
    x = full_inputs()
    inputs, local = local_inputs(x, "zigzag", 2, rank)
    leaves = [t.detach().clone().requires_grad_() for t in inputs.values()]
    weight = x["kv_up_weight"].clone().requires_grad_()
    out = laga_attention(*leaves, weight, softmax_scale=kw.pop("softmax_scale", SCALE),
                         cp_group=dist.group.WORLD, **kw)
    out.backward(local(x["grad_out"]))
    grads = dict(zip(("query", "kv_latent", "k_pos_emb"), (t.grad for t in leaves)))
    grads["kv_up_weight"] = weight.grad
    return {"out": out.detach(), "grads": grads}


def _linear_a(latent, rows, first_row):
    return torch.nn.functional.linear(latent, rows)


def _linear_b(latent, rows, first_row):  # another function: the numbers of F.linear x 1.01
    return torch.nn.functional.linear(latent, rows) * 1.01


def fresh_masks(rank):
    """Equal masks on both ranks, built afresh per call; rank 1 frees each at once (its
    allocator may hand the next mask the same address), rank 0 keeps them all."""
    kept, results = [], []
    for side in ("right", "left", "right"):
        mask = padding_mask(side)
        results.append((side, _layer(rank, key_padding_mask=mask)))
        if rank == 0:
            kept.append(mask)
        del mask
        gc.collect()
    return results


def mask_sequence(rank):
    """Later calls' masks [left, right, left] on rank 0, [left, left, right] on rank 1: the
    same set, another sequence."""
    masks = {side: padding_mask(side) for side in ("right", "left")}
    later = (("left", "right", "left"), ("left", "left", "right"))[rank]
    for side in ("right",) + later:
        _layer(rank, key_padding_mask=masks[side])


def held(rank):
    """A mask first seen in a later call is held until the next micro-batch opens: no
    other tensor can take its address while the micro-batch may still meet it."""
    import weakref

    import torch.distributed as dist
    _layer(rank, key_padding_mask=padding_mask("right"))
    mask = padding_mask("left")
    _layer(rank, key_padding_mask=mask)
    alive = weakref.ref(mask)
    del mask
    gc.collect()
    during = alive() is not None
    settle()
    new_micro_batch(dist.group.WORLD)
    gc.collect()
    return during, alive() is None


def third_call_scale(rank):
    for call in range(3):
        _layer(rank, softmax_scale=SCALE * (1.01 if call == 2 and rank == 1 else 1.0))


def kernel_first(rank):
    _layer(rank, kernel=("eager", "sdpa")[rank])


def kernel_later(rank):
    _layer(rank, kernel="eager")
    _layer(rank, kernel=("eager", "sdpa")[rank])


def unrelated_optimizer(rank):
    """Rank 1 steps an optimizer of its own mid-micro-batch: it holds no weight of a LAGA
    call, so nothing settles (and no rank is left in another call)."""
    _layer(rank)
    if rank == 1:
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1).step()
    _layer(rank)


def check_ranks_one_rank(rank):
    """check_ranks=False on rank 1 alone in a later call: both ranks still make the same
    collectives; the next settle names it."""
    _layer(rank)
    _layer(rank, check_ranks=(None, False)[rank])


def linear_without_code(rank):
    _layer(rank)
    _layer(rank, kv_up_linear=(_linear_a, _linear_b)[rank])


SCENARIOS = {  # name -> what the message names (None: no error)
    "fresh_masks": None,
    "held": None,
    "mask_sequence": "key_padding_mask",
    "third_call_scale": "softmax_scale in a later call (call 3 of the micro-batch): "
                        f"[{SCALE}, {SCALE * 1.01}]",
    "kernel_first": "kernel (the attention kernel): ['eager', 'sdpa']",
    "kernel_later": "kernel (the attention kernel) in a later call (call 2 of the micro-batch):"
                    " ['eager', 'sdpa']",
    "linear_without_code": "kv_up_linear",
    "unrelated_optimizer": None,
    "check_ranks_one_rank": "check_ranks in a later call (call 2 of the micro-batch): "
                            "[True, False]",
}


def _worker(rank, world):
    import torch.distributed as dist
    group, reports = dist.group.WORLD, {}
    for name in SCENARIOS:
        agreement.reset()
        dist.barrier()
        new_micro_batch(group)
        result = error = None
        try:
            result = globals()[name](rank)
            settle()
        except ValueError as exc:
            error = str(exc)
        reports[name] = (error, result)
    return reports


@pytest.fixture(scope="module")
def reports():
    return run_on_ranks(_worker, 2, timeout_s=150)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_rank_names_the_difference_or_none_raises(reports, name):
    needle = SCENARIOS[name]
    for rank, report in enumerate(reports):
        error = report[name][0]
        if needle is None:
            assert error is None, (rank, error)
        else:
            assert error and needle in error, (rank, error)


@pytest.mark.timeout(200)
def test_a_mask_is_held_for_its_micro_batch_only(reports):
    for report in reports:
        assert report["held"][1] == (True, True), report["held"]


@pytest.mark.timeout(200)
def test_fresh_equal_masks_run_exact(reports):
    """No false stop, and every call's numbers are the reference's."""
    per_rank = [r["fresh_masks"][1] for r in reports]
    for call, (side, _) in enumerate(per_rank[0]):
        expected, expected_grads = reference(padding_mask(side))
        out, grads = assemble([per_rank[r][call][1] for r in range(2)], "zigzag", 2)
        assert torch.allclose(out, expected, atol=1e-12, rtol=0), call
        for name, grad in grads.items():
            assert torch.allclose(grad, expected_grads[name], atol=1e-10, rtol=0), (call, name)


def _destroy_worker(rank, world, rounds=6):
    """Groups used in micro-batch mode, then destroyed: nothing of the agreement keeps one,
    and dropping one right after its last collective does not deadlock (torch 2.7.1's gloo
    joins its threads under the GIL; a race, so several rounds)."""
    import weakref

    import torch.distributed as dist
    from mindspeed_laga import comm
    from mindspeed_laga.agreement import schedule
    freed = []
    for _ in range(rounds):
        group = dist.new_group([0, 1])
        new_micro_batch(group)
        for _ in range(2):
            with torch.no_grad():
                laga_attention(*_inputs(rank), softmax_scale=SCALE, cp_group=group)
        settle()
        alive = weakref.ref(group)
        dist.destroy_process_group(group)
        del group
        gc.collect()
        freed.append(alive() is None)
    return all(freed), len(schedule._STATES), len(comm._SKIPPED) + len(comm._LAST_TENSORS)


def _inputs(rank):
    x = full_inputs()
    inputs, _ = local_inputs(x, "zigzag", 2, rank)
    return list(inputs.values()) + [x["kv_up_weight"]]


@pytest.mark.timeout(200)
def test_no_state_outlives_its_group():
    for freed, states, counts in run_on_ranks(_destroy_worker, 2, timeout_s=120):
        assert freed and states == 0 and counts == 0, (freed, states, counts)


def test_device_hash_weights_are_bounded():
    from mindspeed_laga.agreement import content
    for length in range(1, 3 * content.PROBES_KEPT):
        content.device_code(torch.ones(length, dtype=torch.bool))
    assert content._probe.cache_info().currsize == content.PROBES_KEPT


def test_the_documented_names_stay_importable():
    import mindspeed_laga
    from mindspeed_laga import handshake  # the agreement's name before it became a package
    assert handshake is mindspeed_laga.agreement
    for name in ("check_same_weight", "weight_checksum", "reset", "new_micro_batch", "settle"):
        assert callable(getattr(handshake, name)), name
    assert mindspeed_laga.settle is handshake.settle

"""The agreement protocol (mindspeed_laga/agreement/) on two gloo ranks.

In micro-batch mode (``new_micro_batch`` on every rank) the first call of a micro-batch
exchanges and the others exchange nothing; a value that differs on one rank in such a
later call must still raise on every rank, naming it, at the next micro-batch's exchange
or at the settle before the optimizer step, and before any update. Each scenario is one
spawned job, bounded by its timeout; results are compared with a float64 single-process
reference (support/key_padding.py), which knows nothing of the protocol.
"""
from __future__ import annotations

import pytest
import torch

from mindspeed_laga import count_bytes, laga_attention, new_micro_batch, settle
from mindspeed_laga.tools.spawn import run_on_ranks
from support.key_padding import (SCALE, assemble, full_inputs, local_inputs, padding_mask,
                                 reference)

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)


def _layer(rank, weight=None, **kw):
    """One layer call, forward and backward: (output, grads, the collectives it ran);
    ``weight``: the kv_up_weight leaf to use (a fresh copy when None)."""
    import torch.distributed as dist
    x = full_inputs()
    inputs, local = local_inputs(x, "zigzag", 2, rank)
    leaves = [t.detach().clone().requires_grad_() for t in inputs.values()]
    if weight is None:
        weight = x["kv_up_weight"].clone().requires_grad_()
    with count_bytes() as counter:
        out = laga_attention(*leaves, weight, softmax_scale=kw.pop("softmax_scale", SCALE),
                             cp_group=dist.group.WORLD, **kw)
        out.backward(local(x["grad_out"]))
    kinds = [r.kind for r in counter.records]
    grads = dict(zip(("query", "kv_latent", "k_pos_emb"), (t.grad for t in leaves)))
    grads["kv_up_weight"] = weight.grad
    return {"out": out.detach(), "grads": grads}, kinds


def _steady_worker(rank, world):
    import torch.distributed as dist
    mask = padding_mask("right")
    seen, results = [], []
    for _ in range(3):
        new_micro_batch(dist.group.WORLD)
        for _ in range(3):
            result, kinds = _layer(rank, key_padding_mask=mask)
            seen.append(kinds)
            results.append(result)
    settle()
    return seen, results


@pytest.mark.timeout(300)
def test_one_exchange_per_micro_batch_and_none_in_later_calls():
    per_rank = run_on_ranks(_steady_worker, 2, timeout_s=120)
    first = ["handshake", "all_gather", "reduce_scatter"]
    later = ["all_gather", "reduce_scatter"]
    for seen, _ in per_rank:
        assert seen == [first, later, later] * 3, seen
    expected, expected_grads = reference(padding_mask("right"))
    for call in range(9):  # every call exact, the ones that exchanged nothing included
        out, grads = assemble([per_rank[r][1][call] for r in range(2)], "zigzag", 2)
        assert torch.allclose(out, expected, atol=1e-12, rtol=0), call
        for name, grad in grads.items():
            assert torch.allclose(grad, expected_grads[name], atol=1e-10, rtol=0), (call, name)


def _later_call_worker(rank, world, found_at, keywords):
    """Rank 1 passes ``keywords`` in the second call of a micro-batch: that call exchanges
    nothing and runs; the difference must raise at ``found_at`` on both ranks."""
    import torch.distributed as dist
    group = dist.group.WORLD
    report = {}
    weight = full_inputs()["kv_up_weight"].clone().requires_grad_()  # the model's weight
    new_micro_batch(group)
    _layer(rank, weight)
    try:
        if keywords.get("kv_up_linear") == "linear":
            keywords = dict(kv_up_linear=_linear)
        _layer(rank, weight, **(keywords if rank == 1 else {}))
        report["later call"] = None
    except ValueError as exc:
        report["later call"] = str(exc)
    try:
        if found_at == "next micro-batch":
            new_micro_batch(group)
            _layer(rank)
        else:  # the optimizer that steps the weight the calls used
            torch.optim.SGD([weight], lr=0.1).step()
        report["found"] = None
    except ValueError as exc:
        report["found"] = str(exc)
    return report


LATER = {  # name -> (rank 1's keywords in the later call, what the message names)
    "softmax_scale": (dict(softmax_scale=SCALE * 1.01), "softmax_scale"),
    "key padding": (dict(key_padding_mask=padding_mask("left")), "key_padding_mask"),
    "kv_up_linear": (dict(kv_up_linear="linear"), "kv_up_linear"),
}


def _linear(latent, rows, first_row):
    """A custom up-projection: the same numbers as F.linear, another function."""
    return torch.nn.functional.linear(latent, rows)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("found_at", ["next micro-batch", "optimizer step"])
@pytest.mark.parametrize("name", sorted(LATER))
def test_a_difference_in_a_later_call_raises_on_every_rank(name, found_at):
    keywords, needle = LATER[name]
    reports = run_on_ranks(_later_call_worker, 2, found_at, keywords, timeout_s=120)
    for rank, report in enumerate(reports):
        assert report["later call"] is None, (rank, report)  # nothing exchanged, nothing read
        text = report["found"]
        assert text and needle in text and "later call" in text, (rank, text)


def _equal_worker(rank, world):
    import torch.distributed as dist
    group = dist.group.WORLD
    mask = padding_mask("right")
    for _ in range(2):
        new_micro_batch(group)
        _layer(rank, key_padding_mask=mask)
        _layer(rank, softmax_scale=SCALE * 1.01)  # every rank alike: a legitimate change
        # rank 0 reuses the exchanged mask, rank 1 builds an equal one: the same contents
        _layer(rank, key_padding_mask=mask if rank == 0 else mask.clone())
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1).step()
    return "ok"


@pytest.mark.timeout(300)
def test_later_calls_that_differ_alike_on_every_rank_run():
    assert run_on_ranks(_equal_worker, 2, timeout_s=120) == ["ok", "ok"]


def _open_worker(rank, world):
    """The adapters' counter: a module called again outside backward opens a micro-batch;
    a recompute (inside backward) does not."""
    import torch.distributed as dist
    import torch.utils.checkpoint
    from mindspeed_laga import agreement
    from mindspeed_laga.patches.common import in_backward, open_micro_batch
    group = dist.group.WORLD
    layers = [torch.nn.Linear(2, 2) for _ in range(3)]
    calls = []

    def call(layer, x):
        open_micro_batch(layer, group)
        calls.append((agreement.state(group).epoch, in_backward()))
        return layer(x)

    for _ in range(3):
        x = torch.ones(1, 2, requires_grad=True)
        for layer in layers:
            x = torch.utils.checkpoint.checkpoint(call, layer, x, use_reentrant=True)
        x.sum().backward()  # recomputes every checkpointed call inside backward
    return calls


@pytest.mark.timeout(300)
def test_modules_called_again_open_the_next_micro_batch_recompute_does_not():
    calls, _ = run_on_ranks(_open_worker, 2, timeout_s=120)
    forward = [epoch for epoch, in_backward in calls if not in_backward]
    recompute = [epoch for epoch, in_backward in calls if in_backward]
    assert forward == [0, 0, 0, 1, 1, 1, 2, 2, 2], calls
    assert recompute == [0, 0, 0, 1, 1, 1, 2, 2, 2], calls

"""The SFT mask reader (patches/attention_mask.py) on two gloo ranks, as the MindSpeed-LLM
adapter runs it: the reader, then the core with ``check_ranks`` True on a module's first
call and None after, each step a new micro-batch (the agreement exchanges once per
micro-batch, on its first call).

Masks that differ between the ranks must raise on every rank, before any data moves,
whether a rank's mask is new, reused or absent; equal masks must run, whether a rank
reuses its mask object or builds an equal one. A mask that differs in a later call of
a micro-batch (no exchange then) raises on every rank at the settle before the
optimizer step. All scenarios run in one spawned job,
bounded by its timeout (a rank left in a collective its peer never joins fails the job
with gloo's error, not a ValueError).
"""
from __future__ import annotations

import pytest
import torch

from mindspeed_laga import laga_attention
from mindspeed_laga.patches.attention_mask import key_padding_from_mask
from mindspeed_laga.tools.spawn import run_on_ranks
from support.key_padding import B, S, SCALE, full_inputs, local_inputs, padding_mask

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)


def tune_mask(padding: torch.Tensor) -> torch.Tensor:
    """get_tune_attention_mask's [b, 1, S, S] (True = masked) for a [b, S] key padding."""
    seq = padding.shape[1]
    visible = torch.ones(seq, seq, dtype=torch.bool).tril()[None] & ~padding[:, None, :]
    return (~visible)[:, None]


def _group():
    import torch.distributed as dist
    return dist.group.WORLD


def _adapter_step(rank, mask, first, new_micro_batch=True):
    """What the adapter does per layer call: read the mask, then the core."""
    from mindspeed_laga import agreement
    group = _group()
    if new_micro_batch:
        agreement.new_micro_batch(group)
    x = full_inputs()
    inputs, _ = local_inputs(x, "zigzag", 2, rank)
    padding = key_padding_from_mask(mask, S, B, group)
    return laga_attention(*inputs.values(), x["kv_up_weight"], softmax_scale=SCALE,
                          cp_group=group, key_padding_mask=padding,
                          check_ranks=True if first else None).detach()


def _forty_step(rank, mask):
    """A layer call at S = 40, micro-batch 1: the reader, then the core."""
    from mindspeed_laga import agreement
    group = _group()
    agreement.new_micro_batch(group)
    g = torch.Generator().manual_seed(1)
    query = torch.randn(20, 1, 2, 6, generator=g, dtype=torch.float64)
    latent = torch.randn(20, 1, 8, generator=g, dtype=torch.float64)
    k_pe = torch.randn(20, 1, 2, generator=g, dtype=torch.float64)
    weight = torch.randn(16, 8, generator=g, dtype=torch.float64)
    padding = key_padding_from_mask(mask, 40, 1, group)
    return laga_attention(query, latent, k_pe, weight, softmax_scale=0.5, cp_group=group,
                          layout="contiguous", key_padding_mask=padding)


def _try(call):
    try:
        return call(), None
    except ValueError as exc:
        return None, str(exc)


def _worker(rank, world):
    from mindspeed_laga import agreement
    right, left = tune_mask(padding_mask("right")), tune_mask(padding_mask("left"))
    report = {}
    first, _ = _try(lambda: _adapter_step(rank, right, True, new_micro_batch=False))
    _adapter_step(rank, right, False)
    # one rank reuses its mask object, the other builds an equal one: both run
    again, report["reused vs equal"] = _try(
        lambda: _adapter_step(rank, right if rank == 0 else right.clone(), False))
    report["same output"] = again is not None and torch.equal(again, first)
    # rank 0 gets a new padded mask, rank 1 none: both raise
    _, report["mask vs none"] = _try(lambda: _adapter_step(rank, (left, None)[rank], False))
    # right padding 8 vs left 24 at S = 40: a linear checksum of the padding collides
    forty = [torch.zeros(1, 40, dtype=torch.bool) for _ in range(2)]
    forty[0][0, 32:], forty[1][0, :24] = True, True
    _, report["right 8 vs left 24"] = _try(lambda: _forty_step(rank, tune_mask(forty[rank])))
    # a later call of one micro-batch: rank 1's mask differs there; no exchange runs in that
    # call, the settle (where the host steps) raises on both ranks
    _adapter_step(rank, right, False)
    _, report["later call"] = _try(
        lambda: _adapter_step(rank, (right, left)[rank], False, new_micro_batch=False))
    _, report["settle"] = _try(agreement.settle)
    agreement.reset()
    return report


@pytest.mark.timeout(300)
def test_masks_that_differ_raise_together_and_equal_ones_run():
    reports = run_on_ranks(_worker, 2, timeout_s=120)
    for rank, report in enumerate(reports):
        assert report["reused vs equal"] is None and report["same output"], (rank, report)
        assert "key_padding_mask" in report["mask vs none"], (rank, report)
        text = report["right 8 vs left 24"]
        assert text and "[[8], [24]]" in text and "padding keys per sample" in text, (rank, text)
        assert report["later call"] is None, (rank, report)  # nothing exchanged, nothing read
        text = report["settle"]
        assert text and "key_padding_mask" in text and "later call" in text, (rank, text)

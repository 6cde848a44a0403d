"""A K/V up-projection adapter LAGA cannot read on one CP rank only: every rank must raise
at once with that cause, on the module's first call (patches/common.py:
``check_weight_once`` reads the weight after the ranks met, and the failure travels in
the same-weight exchange), not leave its peer waiting ``MINDSPEED_LAGA_PEER_WAIT_S``
for a rank that has already failed and then blame a missing patch.

Through the megatron-core patch's first-call check, on two gloo ranks, bounded by the
spawn timeout; the peer wait is set to 60 s, so a peer left waiting shows in the time.
"""
from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
from torch import nn

from mindspeed_laga.tools.spawn import run_on_ranks
from support.thirdparty import require_peft
from support.unknown_adapter import UnknownAdapter

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

PEER_WAIT_S = 60


def _kv_up_proj(rank, variant):
    import torch
    torch.manual_seed(0)
    base = nn.Linear(8, 12, bias=False)
    if rank == 0:
        return base
    if variant == "unknown wrapper":
        return UnknownAdapter(base)
    from peft.tuners import lora
    return lora.Linear(base, "default", r=3, lora_alpha=6, lora_dropout=0.1)


def _worker(rank, world, variant):
    import torch.distributed as dist
    from mindspeed_laga import laga_attention
    from mindspeed_laga.patches.megatron_core.mla import MegatronPatchSettings, check_first_call
    os.environ["MINDSPEED_LAGA_PEER_WAIT_S"] = str(PEER_WAIT_S)
    module = SimpleNamespace(linear_kv_up_proj=_kv_up_proj(rank, variant))
    settings = MegatronPatchSettings(form="laga", core=laga_attention, cp_algo="allgather",
                                     layout="zigzag", kernel="auto")
    start = time.monotonic()
    try:
        check_first_call(module, settings, dist.group.WORLD)
        text = None
    except Exception as exc:  # noqa: BLE001 -- the type is part of the report
        text = f"{type(exc).__name__}: {exc}"
    return text, time.monotonic() - start


def _assert_raised_together(variant, cause):
    for rank, (text, seconds) in enumerate(run_on_ranks(_worker, 2, variant, timeout_s=120)):
        assert text and cause in text and "did not reach" not in text, (rank, text)
        assert seconds < PEER_WAIT_S / 2, (rank, seconds, text)


@pytest.mark.timeout(300)
def test_an_adapter_one_rank_cannot_read_raises_on_every_rank_at_once():
    _assert_raised_together("unknown wrapper", "UnknownAdapter")


@pytest.mark.hosts
@pytest.mark.timeout(300)
def test_lora_dropout_on_one_rank_raises_on_every_rank_at_once():
    require_peft()
    _assert_raised_together("dropout", "lora_dropout 0.1")

"""Skip mode: once every rank passed ``check_ranks=False`` the group skips the exchange, and a
local check that fails on one rank only (a key_padding_mask of the wrong shape,
``kv_block_size=0``) can tell its peers nothing before they enter the data collective
(no exchange, no host sync: that is what skipping saves). The peers must still raise
that rank's error, naming it, when their collective fails (gloo: once the failing
process has left), not gloo's "Connection closed" alone.

Each case is one spawned job of two gloo ranks, bounded by its timeout; each rank
writes what it raised and leaves at once (its peer is stuck until it leaves).
"""
from __future__ import annotations

import pytest

from mindspeed_laga import laga_attention
from mindspeed_laga.tools.spawn import WorkerError, run_on_ranks
from support.key_padding import SCALE, full_inputs, local_inputs, padding_mask
from support.raise_together import report_and_leave

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

CASES = {  # name -> (rank 1's keywords, what rank 1 raises, its cause in rank 0's error)
    "kv_block_size": (dict(recompute_kv=True, kv_block_size=0), "ValueError: kv_block_size",
                      "kv_block_size must be a positive int"),
    "mask shape": (dict(key_padding_mask=padding_mask("right")[:, :16]),
                   "ValueError: key_padding_mask", "key_padding_mask must be [micro-batch"),
}


def _attend(rank, check_ranks=False, **kw):
    import torch.distributed as dist
    x = full_inputs()
    inputs, _ = local_inputs(x, "zigzag", 2, rank)
    out = laga_attention(*inputs.values(), x["kv_up_weight"], softmax_scale=SCALE,
                         cp_group=dist.group.WORLD, check_ranks=check_ranks, **kw)
    out.sum().backward()


def _worker(rank, world, out_dir, case):
    _attend(rank)  # every rank passed check_ranks=False: the group skips from here on
    report_and_leave(out_dir, rank, lambda: _attend(rank, **(CASES[case][0] if rank else {})))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_local_failure_in_a_skipped_call_names_its_cause_on_every_rank(tmp_path, case):
    _, own, cause = CASES[case]
    with pytest.raises(WorkerError):  # both ranks leave without reporting
        run_on_ranks(_worker, 2, str(tmp_path), case, timeout_s=120)
    failing, peer = (tmp_path / "rank1").read_text(), (tmp_path / "rank0").read_text()
    assert failing.startswith(own) and "check_ranks=False" in failing, failing
    assert peer.startswith("ValueError: CP rank(s) [1]") and cause in peer, peer
    assert "check_ranks=False" in peer, peer


def _later_worker(rank, world, out_dir, case):
    """The same failure in a later call of a micro-batch (which exchanges nothing either)."""
    import torch.distributed as dist

    from mindspeed_laga import new_micro_batch
    new_micro_batch(dist.group.WORLD)
    _attend(rank, check_ranks=None)  # the micro-batch's first call exchanges
    report_and_leave(out_dir, rank, lambda: _attend(rank, check_ranks=None,
                                                    **(CASES[case][0] if rank else {})))


@pytest.mark.timeout(300)
def test_a_local_failure_in_a_later_call_names_its_cause_and_no_argument_nobody_passed(
        tmp_path):
    _, own, cause = CASES["kv_block_size"]
    with pytest.raises(WorkerError):  # both ranks leave without reporting
        run_on_ranks(_later_worker, 2, str(tmp_path), "kv_block_size", timeout_s=120)
    failing, peer = (tmp_path / "rank1").read_text(), (tmp_path / "rank0").read_text()
    for text in (failing, peer):
        assert "a later call of a micro-batch" in text and "check_ranks=False" not in text, text
    assert failing.startswith(own), failing
    assert peer.startswith("ValueError: CP rank(s) [1]") and cause in peer, peer

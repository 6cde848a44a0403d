"""The megatron-core patch configured differently on the CP ranks: the ranks must raise
together, before any process group is built or a collective runs, never hang or abort.
Real megatron-core on two gloo ranks; every job bounded by its timeout."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("megatron.core")
from mindspeed_laga.tools import megatron_cpu as mc  # noqa: E402

from mindspeed_laga.tools.spawn import WorkerError, run_on_ranks  # noqa: E402
from support.raise_together import report_and_leave  # noqa: E402

pytestmark = pytest.mark.mcore  # the leg that runs it (tests/conftest.py)

MISMATCHES = {  # name -> (rank 0's patch, rank 1's patch, the expected message)
    "hybrid_vs_allgather": (dict(cp_algo="hybrid", ulysses_degree=2), dict(cp_algo="allgather"),
                            "CP ranks disagree on patch_megatron_mla(cp_algo=): "
                            "['hybrid', 'allgather']"),
    "ulysses_degree": (dict(cp_algo="hybrid", ulysses_degree=2),
                       dict(cp_algo="hybrid", ulysses_degree=1),
                       "CP ranks disagree on patch_megatron_mla(ulysses_degree=): [2, 1]"),
}


def _step(patch):
    import mindspeed_laga
    mindspeed_laga.patch_megatron_mla(**patch)
    tiny = mc.TinyMLA()
    try:
        mc.train(mc.build_tiny_mla_gpt(tiny, cp=2), mc.make_batches(tiny, 1))
    except ValueError as exc:
        return str(exc)
    finally:
        mindspeed_laga.unpatch_megatron_mla()
    return None


def _mismatch_worker(rank, world, names):
    mc.init_parallel(cp=world)
    return {name: _step(MISMATCHES[name][rank]) for name in names}


@pytest.mark.timeout(300)
def test_ranks_patched_with_other_settings_raise_together_before_any_group():
    reports = run_on_ranks(_mismatch_worker, 2, sorted(MISMATCHES), timeout_s=120)
    for name, (_, _, expected) in MISMATCHES.items():
        for rank, report in enumerate(reports):
            assert report[name] is not None and expected in report[name], (name, rank, report)


def _one_rank_patched_worker(rank, world, out_dir):
    """Rank 0 patched, rank 1 not. Each writes what it raised and leaves at once (its peer
    is stuck in a collective: the usual end-of-job barrier would never meet)."""
    import mindspeed_laga
    mc.init_parallel(cp=world)
    os.environ["MINDSPEED_LAGA_PEER_WAIT_S"] = "5"
    if rank == 0:
        mindspeed_laga.patch_megatron_mla()
    tiny = mc.TinyMLA()
    report_and_leave(out_dir, rank, lambda: mc.train(mc.build_tiny_mla_gpt(tiny, cp=2),
                                                     mc.make_batches(tiny, 1)))


@pytest.mark.timeout(300)
def test_a_rank_without_the_patch_is_named_by_the_patched_rank(tmp_path):
    with pytest.raises(WorkerError):  # both ranks leave without reporting
        run_on_ranks(_one_rank_patched_worker, 2, str(tmp_path), timeout_s=90)
    patched = (tmp_path / "rank0").read_text()
    assert "RuntimeError: mindspeed_laga: CP rank(s) [1] (global) did not reach" in patched
    assert "applied on every rank" in patched
    # the unpatched rank learns of it from the backend only (its own collective fails once
    # the patched rank has left): docs/MEGATRON.md
    assert (tmp_path / "rank1").exists()

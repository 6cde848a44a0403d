"""What every real-loop test module shares: the tolerances, the bound on one run, and the
checks that a run trained as its CP = 1 reference did and that LAGA (or the host) ran.

The tolerances were measured on the pretrain loop: CP = 2 against CP = 1 moves the loss by
at most 2.6e-7 and the grad norm by 2.2e-6, while a 1% softmax-scale error moves them by
3.3e-5 and 9.4e-4; the fine-tune and layout loops use the same bounds.
"""
from __future__ import annotations

from . import real_loop

LOSS_RTOL = 2e-6       # measured noise 2.6e-7; the 1%-scale mutant moves losses 3.3e-5
GRAD_NORM_RTOL = 1e-5  # measured noise 2.2e-6; the mutant moves the grad norm 9.4e-4
PRINTED_RTOL = 2e-6    # the log prints 7 significant digits
RUN_TIMEOUT_S = 420    # one torchrun, on a loaded 2-core machine


def assert_same_training(run, ref, iterations=real_loop.ITERATIONS):
    """Every iteration ran, none skipped, losses and grad norms within the tolerances of
    CP = 1's; MTP losses (where printed) within the printed digits."""
    assert sorted(run.iterations) == list(range(1, iterations + 1)), run.iterations
    assert not any(v["skipped"] for v in run.iterations.values())
    for key, rtol in (("lm loss", LOSS_RTOL), ("grad norm", GRAD_NORM_RTOL)):
        got, want = run.series(key), ref.series(key)
        errors = [abs(g - w) / abs(w) for g, w in zip(got, want)]
        assert max(errors) <= rtol, f"{key}: {got} vs CP=1 {want} (relative {errors})"
    for i, printed in ref.printed.items():
        for key, want in printed.items():
            if key.startswith("mtp"):
                got = run.printed[i][key]
                assert abs(got - want) <= PRINTED_RTOL * abs(want), (i, key, got, want)


def require_loop_modules():
    """As host_sources does: skip naming what the loop lacks, fail under CI=true."""
    missing = real_loop.missing_modules()
    if missing:
        from support.thirdparty import skip_or_fail
        skip_or_fail(f"the real loop needs: pip install {' '.join(missing)}")


def assert_release_found(run, release):
    """The run's log says the launcher found this release's sources (not another's)."""
    from patches.mindspeed_llm.releases import BY_NAME
    assert BY_NAME[release].found() in run.log, f"not {release}'s sources"


def assert_ran(run, laga: bool):
    """Every rank made MLA forwards; each ran LAGA's attention (laga) or the host's (not)."""
    for rank, counts in enumerate(run.counts):
        where = f"rank {rank}: {counts}"
        assert counts.get("mla_forward", 0) > 0, where
        if laga:
            assert counts.get("laga_attention", 0) == counts["mla_forward"], where
            assert counts.get("core_attention", 0) == 0, "the host's core attention ran: " + where
            assert counts.get("npu_fusion_attention", 0) == 0, where
        else:
            assert counts.get("laga_attention", 0) == 0, where
            assert counts.get("core_attention", 0) == counts["mla_forward"], where

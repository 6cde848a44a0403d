"""LAGA through MindSpeed-LLM's own training loop: the unmodified ``pretrain_gpt.py``
under ``torchrun ... -m mindspeed_laga.launch`` on gloo CPU ranks (tests/support/loop/real_loop.py).

Every case trains the scaled-down stock DeepSeek-V3 recipe (MLA with q-lora,
qk-layernorm and yarn rope; MoE with a shared expert; MTP) for a few iterations on a
real Megatron indexed dataset, with ``--mla-latent-all-gather`` at CP > 1, and must
equal the CP = 1 run of the same recipe iteration by iteration: the LM loss and the
grad norm at full precision (recorded from the host's ``training_log``) and the
printed MTP loss. At CP = 1 LAGA is a no-op, so the reference is the host's own MLA
with its core attention (the strict ``npu_fusion_attention`` stand-in).

Tolerances, measured on this recipe (docs/INTEGRATION.md, "The real training loop"):
the same run twice is bitwise equal; CP = 2 or 4 against CP = 1 differs by at most
2.6e-7 (losses) and 2.2e-6 (grad norms) relative over all cases. A 1% error in LAGA's
softmax scale moves the losses by up to 3.3e-5 and the grad norm by up to 9.4e-4
(1.5e-5 already at iteration 1), so each of the two tolerances below fails it alone.

Each rank counts its calls (tests/support/loop/bootstrap): LAGA's attention must have run on
every MLA forward and the host's core attention never, so a silent fallback to the
original forward fails.

Every other tested release pair (26.1.0, 26.0.0, 2.3.0, 2.2.0) runs one case the same way
against its own CP = 1 run, on its own sources (test_release_loop_equals_cp1); what its
stock recipe cannot run at CP > 1 is shown refused at start-up (test_release_loop_refused).

The host's CP-local router terms (``--seq-aux``,
``--moe-router-enable-expert-bias``) are left out of the recipe: the host itself is
not CP-invariant with them (real_loop.HOST_CP_VARIANT).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from mindspeed_laga.patches.mindspeed_llm.releases import BY_NAME
from support.loop import background, real_loop
from support.loop.steady_state import assert_steady_state
from support.loop.compare import (RUN_TIMEOUT_S, assert_release_found, assert_same_training,
                                  require_loop_modules)
from support.thirdparty import RELEASE_NAMES, release_sources

pytestmark = [pytest.mark.ascend, pytest.mark.loop, pytest.mark.hosts]

MTP = ["--mtp-num-layers", "--mtp-loss-scaling-factor", "--mtp-mem-efficient-logits"]


def _runner(sources, workdir):
    """run(name, cp, algo, laga, **recipe): one loop of the scaled-down stock recipe on these
    host sources, each name run once (writable sources and the dataset prepared here);
    run.start(name, ...) begins it in the background (support/loop/background.py)."""
    require_loop_modules()

    def argv_for(ready, cp, algo="ulysses_cp_algo", laga=True, every_rank_exits=False,
                 **recipe):
        return (real_loop.recipe(Path(ready["sources"]["MINDSPEED_LLM_SRC"]), cp, algo, laga,
                                 ready["data_path"], **recipe), cp,
                dict(every_rank_exits=every_rank_exits))

    return background.Runner(sources, workdir, argv_for, RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def loop(host_sources, tmp_path_factory):
    """The master pair's runner, shared by every master case of this module."""
    return _runner(host_sources, tmp_path_factory.mktemp("real-loop"))


def _reference_name(recipe) -> str:
    settings = "-".join(f"{k}={v}" for k, v in sorted(recipe.items()))
    return re.sub(r"[^\w=.-]+", "_", "cp1-" + settings)


def _start_reference(loop, **recipe):
    """Start the CP = 1 run in the background, beside the multi-rank run it is compared with."""
    loop.start(_reference_name(recipe), 1, **recipe)


def _reference(loop, **recipe):
    """CP = 1 with --mla-latent-all-gather: a no-op, so the host's own attention runs."""
    ref = loop(_reference_name(recipe), 1, **recipe)
    for counts in ref.counts:
        assert counts.get("laga_attention", 0) == 0, counts
        assert counts["core_attention"] == counts["mla_forward"] > 0, counts
    losses = ref.series("lm loss")
    assert max(losses) - min(losses) > 1e-3, f"the losses do not move: {losses}"
    return ref


def expected_mla_calls(run) -> int:
    """MLA forwards per rank: layers (+ MTP layers) x micro-batches x iterations."""
    layers = int(run.argv[run.argv.index("--num-layers") + 1])
    if "--mtp-num-layers" in run.argv:
        layers += int(run.argv[run.argv.index("--mtp-num-layers") + 1])
    return layers * real_loop.MICRO_BATCHES * real_loop.ITERATIONS


def assert_laga_ran_everywhere(run, recomputed=False):
    expected = expected_mla_calls(run)
    for rank, counts in enumerate(run.counts):
        where = f"rank {rank}: {counts}"
        assert counts.get("core_attention", 0) == 0, "the host's core attention ran: " + where
        assert counts.get("npu_fusion_attention", 0) == 0, where
        assert counts.get("npu_fusion_attention_grad", 0) == 0, where
        assert counts["laga_attention"] == counts["mla_forward"], where
        if recomputed:  # full recompute runs the forward again in backward
            assert counts["mla_forward"] > expected, where
        else:
            assert counts["mla_forward"] == expected, where


CASES = {
    "ulysses_cp_algo": dict(cp=2, algo="ulysses_cp_algo"),
    "kvallgather_cp_algo": dict(cp=2, algo="kvallgather_cp_algo"),
    "megatron_cp_algo-full-recompute": dict(cp=2, algo="megatron_cp_algo", recompute=True),
    "hybrid_cp_algo-u2": dict(cp=4, algo="hybrid_cp_algo", ulysses_degree=2),
}


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
@pytest.mark.parametrize("case", list(CASES))
def test_loop_equals_cp1(loop, case):
    _start_reference(loop)
    run = loop(case, **CASES[case])
    assert_laga_ran_everywhere(run, recomputed=CASES[case].get("recompute", False))
    assert_same_training(run, _reference(loop))
    assert_steady_state(run, real_loop.MICRO_BATCHES, real_loop.ITERATIONS)


# --- packed documents (--reset-attention-mask, micro-batch 1) --------------------------------
#
# ulysses and kvallgather: the stock recipe as shipped (MTP included); the host splits the
# batch contiguously and LAGA reads each MTP depth's document ends.
# megatron_cp_algo: the host's loader fails with MTP and documents before any attention runs
# (its per-document split takes one row of ends, MTP keeps one per depth), so MTP is left
# out; and without --reset-position-ids MindSpeed-LLM's THD rope slices the rope table
# contiguously while the batch is split per document, so the host trains other positions at
# CP = 2 than at CP = 1: the case resets positions (rope is relative within a document, so
# the CP = 1 model is the same either way). MindSpeed pads every document to a multiple of
# 2 * CP there; the pads come after each document's EOD with no loss, so the padded stream
# trains the same model as CP = 1.
DOCUMENT_CASES = {
    "documents-ulysses_cp_algo": dict(cp=2, algo="ulysses_cp_algo"),
    "documents-kvallgather_cp_algo": dict(cp=2, algo="kvallgather_cp_algo"),
    "documents-megatron_cp_algo": dict(cp=2, algo="megatron_cp_algo", without=MTP,
                                       extra=["--reset-position-ids"]),
}


@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
@pytest.mark.parametrize("case", list(DOCUMENT_CASES))
def test_documents_loop_equals_cp1(loop, case):
    settings = dict(DOCUMENT_CASES[case], documents=True)
    cp, algo = settings.pop("cp"), settings.pop("algo")
    _start_reference(loop, **settings)
    run = loop(case, cp, algo, **settings)
    assert_laga_ran_everywhere(run)
    assert_same_training(run, _reference(loop, **settings))
    assert_steady_state(run, real_loop.MICRO_BATCHES, real_loop.ITERATIONS)


# --- the other release pairs ------------------------------------------------------------------
#
# Each release pair trains its own stock recipe (scaled down the same way) with LAGA at CP = 2
# and must equal that release's own CP = 1 run, as master does above. What a release's recipe
# leaves out, and why:
# - 2.3.0 and 2.2.0: MTP. Megatron core_v0.12.1's validate_args asserts "Multi-Token
#   Prediction (MTP) is not supported with Context Parallelism" whatever the other flags, and
#   only MindSpeed-LLM 26.0.0 and later lift it, so these releases cannot train MTP at CP > 1,
#   LAGA on or off (test_release_loop_refused).
# - 2.2.0: --reset-position-ids, the documents switch its stock recipe ships (it sets
#   --shape-order TND); LAGA refuses packed documents on 2.2.0 (its MLA forward cannot rope
#   them; patches/mindspeed_llm/releases.py) and says so at start-up (test_release_loop_refused).

# Keyed by the release that owns the facts (a release declared the same as another runs its
# case); every other release runs the stock recipe whole, as the newest do.
LEAVES_OUT = {
    "2.3.0": dict(without=MTP),
    "2.2.0": dict(without=MTP + ["--reset-position-ids"]),
}
# master's own case is the module's first test; every other release row, one case each
RELEASE_CASES = {name: LEAVES_OUT.get(BY_NAME[name].facts_owner, dict())
                 for name in RELEASE_NAMES if name != "master"}


@pytest.fixture(scope="module")
def release_loop(tmp_path_factory):
    """release -> that pair's runner (sources prepared once per release)."""
    runners = {}

    def get(release):
        if release not in runners:
            runners[release] = _runner(release_sources(release),
                                       tmp_path_factory.mktemp(f"real-loop-{release}"))
        return runners[release]

    return get


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
@pytest.mark.parametrize("release", list(RELEASE_CASES))
def test_release_loop_equals_cp1(release_loop, release):
    loop = release_loop(release)
    _start_reference(loop, **RELEASE_CASES[release])
    run = loop("ulysses_cp_algo", 2, "ulysses_cp_algo", **RELEASE_CASES[release])
    assert_release_found(run, release)
    assert_laga_ran_everywhere(run)
    assert_same_training(run, _reference(loop, **RELEASE_CASES[release]))
    assert_steady_state(run, real_loop.MICRO_BATCHES, real_loop.ITERATIONS)


# (release, what the case leaves out of its stock recipe, the refusal every rank prints);
# each case keeps one refused part, so the message it expects is the one that stops it
REFUSED = {
    "2.3.0-mtp": ("2.3.0", dict(), "Multi-Token Prediction (MTP) is not supported with Context "
                                   "Parallelism"),
    "2.2.0-mtp": ("2.2.0", dict(without=["--reset-position-ids"]),
                  "Multi-Token Prediction (MTP) is not supported with Context Parallelism"),
    "2.2.0-reset-position-ids": ("2.2.0", dict(without=MTP),
                                 "ValueError: --mla-latent-all-gather with --shape-order TND is "
                                 "not supported"),
}


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", list(REFUSED))
def test_release_loop_refused(release_loop, case):
    """What RELEASE_CASES leaves out stops at start-up, on every rank, before iteration 1."""
    release, recipe, refusal = REFUSED[case]
    with pytest.raises(real_loop.LoopFailed) as failed:
        release_loop(release)(f"refused-{case}", 2, "ulysses_cp_algo", every_rank_exits=True,
                              **recipe)
    log = failed.value.log
    assert log.count(refusal) >= 2, failed.value  # both ranks refuse
    assert not real_loop.parse_log(log), "it trained before refusing"

"""MindSpeed-LLM's other MLA families through its own training loop (tests/support/loop):
each stock recipe, shrunk as the DeepSeek-V3 cases shrink theirs (tests/support/loop/families.py),
trains with ``--mla-latent-all-gather`` at CP > 1 and must equal the same recipe at CP = 1
without the flag, iteration by iteration (loss and grad norm at full precision,
tests/support/loop/compare.py's tolerances):

- Kimi-K2, PLM and MiniCPM3 at CP 2 (ulysses) (MiniCPM3 at 4x the learning rate, see
  families.py);
- LongCat-Flash's 128k recipe at CP 4 (ulysses, packed sub-sequences of fixed length, two
  MLA per layer);
- DeepSeek-V2-Lite at CP 2 twice: its stock router balance (``pai_megatron_aux_loss`` with
  ``--seq-aux``) is computed on each CP rank's tokens, so the host itself trains another
  model at CP 2 than at CP 1: there the reference is the host's own CP 2 run (flag off);
  and with ``--moe-router-load-balancing-type none`` against CP 1.

As in the DeepSeek-V3 cases, Kimi-K2's and LongCat's CP-local router terms (``--seq-aux``,
``--moe-router-enable-expert-bias``: real_loop.HOST_CP_VARIANT) are left out. Measured:
every case within 1.7e-7 (losses) and 2.1e-7 (grad norms) of its reference; a 1% error in
LAGA's softmax scale moves each case's loss by 3.1e-6 to 4.3e-5 and its grad norm by
2.5e-5 to 1.5e-3, beyond both tolerances (docs/INTEGRATION.md, "The other MLA families in
the loop").

Each rank counts its calls: LAGA's attention ran on every MLA forward (twice per layer for
LongCat) and the host's core attention never.

DeepSeek-V4-Flash's 128k recipe builds ``DeepSeek4SelfAttention``, which LAGA does not
patch: with the flag both ranks refuse once the model is built, before iteration 1.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from support.loop import background, families, real_loop
from support.loop.steady_state import assert_steady_state
from support.loop.compare import (RUN_TIMEOUT_S, assert_ran, assert_same_training,
                                  require_loop_modules)

pytestmark = [pytest.mark.ascend, pytest.mark.loop, pytest.mark.hosts]

NO_BALANCE = {"--moe-router-load-balancing-type": "none"}
# case -> (family, how the case differs from the stock recipe, the reference: "cp1" (CP 1,
# flag off) or "host" (the same CP, flag off))
CASES = {
    "kimi2": ("kimi2", {}, "cp1"),
    "plm": ("plm", {}, "cp1"),
    "minicpm3": ("minicpm3", {}, "cp1"),
    "longcat-128k": ("longcat", dict(documents=True), "cp1"),
    "deepseek2_lite-stock": ("deepseek2_lite", dict(extra=["--seq-aux"]), "host"),
    "deepseek2_lite-no-balance": ("deepseek2_lite", dict(layout=NO_BALANCE), "cp1"),
}


@pytest.fixture(scope="module")
def family_loop(host_sources, tmp_path_factory):
    """run(name, family, cp, laga, **recipe): one loop of a family's shrunk recipe on the
    master pair (sources and the dataset prepared once for every case); run.start(name, ...)
    begins it in the background."""
    require_loop_modules()

    def argv_for(ready, family, cp, laga, every_rank_exits=False, **recipe):
        llm = Path(ready["sources"]["MINDSPEED_LLM_SRC"])
        argv = families.family_recipe(llm, family, cp, laga, ready["data_path"], **recipe)
        return argv, real_loop.ranks(argv), dict(script=families.family_named(family).entry,
                                                 every_rank_exits=every_rank_exits)

    return background.Runner(host_sources, tmp_path_factory.mktemp("family-loop"), argv_for,
                             RUN_TIMEOUT_S)


def assert_laga_on_every_mla(run, family):
    """LAGA ran on every MLA forward: layers x MLA per layer x micro-batches x iterations."""
    assert_ran(run, laga=True)
    layers = int(real_loop.flag_value(run.argv, "--num-layers"))
    expected = (layers * families.family_named(family).mla_per_layer * real_loop.MICRO_BATCHES
                * real_loop.ITERATIONS)
    for rank, counts in enumerate(run.counts):
        assert counts["mla_forward"] == expected, f"rank {rank}: {counts}"


@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
@pytest.mark.parametrize("case", list(CASES))
def test_family_loop_equals_reference(family_loop, case):
    family, recipe, against = CASES[case]
    cp = families.family_named(family).cp
    reference = (f"{case}-reference", family, 1 if against == "cp1" else cp, False)
    if against == "cp1":  # one rank: it runs beside the multi-rank run (support/loop/background.py)
        family_loop.start(*reference, **recipe)
    run = family_loop(case, family, cp, True, **recipe)
    assert_laga_on_every_mla(run, family)
    assert_same_training(run, check_reference(family_loop(*reference, **recipe)))
    assert_steady_state(run, real_loop.MICRO_BATCHES, real_loop.ITERATIONS)


def check_reference(ref):
    assert_ran(ref, laga=False)
    losses = ref.series("lm loss")
    assert max(losses) - min(losses) > 1e-3, f"the losses do not move: {losses}"
    return ref


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_deepseek4_refused_on_every_rank(family_loop):
    """The flag with DeepSeek-V4's own attention: every rank names the class and stops."""
    with pytest.raises(real_loop.LoopFailed) as failed:
        family_loop("deepseek4", "deepseek4", families.DEEPSEEK4.cp, True, every_rank_exits=True)
    log = failed.value.log
    refusal = ("ValueError: --mla-latent-all-gather does not apply to this model: it has no "
               "CustomMLASelfAttention, its attention is DeepSeek4MTPSelfAttention, "
               "DeepSeek4SelfAttention")
    for rank in range(families.DEEPSEEK4.cp):
        assert f"[rank{rank}]: {refusal}" in log, failed.value
    assert "one shared compressed KV head, 512 wide" in log
    assert not real_loop.parse_log(log), "it trained before refusing"

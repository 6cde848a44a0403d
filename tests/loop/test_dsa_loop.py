"""MindSpeed-LLM's sparse MLA (DSA) recipes through its own training loop, with LAGA.

The three DSA recipes of the master sources, scaled down (tests/support/loop/dsa_loop.py
says what changes from each and why): DeepSeek-V3.2's 16K tune (SFT, ``--no-pad-to-seq-lengths``,
``ulysses_cp_algo``) at CP 2, its 128K kvallgather tune at CP 4, GLM-5's pretrain
(``ulysses_cp_algo``) at CP 2. Each trains with ``--mla-latent-all-gather`` and must
equal the host's own CP 1 run of the same recipe without the flag, iteration by
iteration: LM loss and grad norm at full precision within the loop tolerances
(tests/support/loop/compare.py), the printed MTP and indexer losses within their printed
digits.

LAGA's DSA adapter runs the host's non-fused DSA path: each case leaves out the
recipe's fused flags (dsa_loop.NON_FUSED: the 16K tune's ``--use-fused-lightning-indexer``,
the 128K tune's ``--use-fused-lightning-indexer --use-fused-lightning-indexer-loss
--use-sparse-flash-attn --enable-mla-absorb``, GLM-5's ``--use-sparse-flash-attn
--enable-mla-absorb``), in the run and in its reference. The host's own fused path of
the 128K tune, as shipped, runs at CP 1 on the CPU stand-ins of the fused ops
(tests/support/fake_dsa_ops.py) in test_host_fused_recipe_trains.

Once LAGA runs the fused DSA path, each case runs the recipe as shipped: NON_FUSED's
entries empty, the host's fused CP 1 run the reference (test_host_fused_recipe_trains
then folds into the 128K case). The host's fused runs do not train the model its torch
path trains on these stand-ins (indexer losses at iteration 1: 128K 4.75e-3 against
1.43e-3, GLM-5 2.68 against 2.98e-3), so they cannot stand in for each other.

Each rank counts its calls: LAGA's sparse attention ran on every MLA forward (layers,
MTP's included, x micro-batches x iterations) and the host's core attention never.

Measured (4 iterations): every case within 8.6e-8 (losses), 1.2e-6 (grad norms) and
6.3e-6 (indexer losses) of its reference. Mutants of LAGA's sparse MLA tried by hand,
each failing every case: the index keys taken from the neighbouring rank's chunk (from
iteration 1: losses 3.6e-4 to 2.0e-2, grad norms 1.3e-3 to 2.9e-1 off) and the indexer
loss's gradient dropped (grad norms 1e-5 to 9e-5 off at iteration 1, 1e-2 at iteration 2;
indexer losses 4e-2 to 4e-1 off from iteration 2).

The ranks order ``torch.topk``'s ties by position (dsa_loop.run): the indexer's scores tie
at exactly 0, and with CPU's own order the host's 16K tune picks other keys than LAGA's
position order from iteration 3 on.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from support import fake_dsa_ops
from support.loop import dsa_loop, real_loop
from support.loop.compare import RUN_TIMEOUT_S, assert_same_training, require_loop_modules

pytestmark = [pytest.mark.ascend, pytest.mark.loop, pytest.mark.hosts]

INDEXER_LOSS = "dsa_indexer_loss"  # as the host prints it
# the indexer's KL loss in float32 sums terms far larger than itself: CP runs move it by up
# to 6e-6 (measured), beyond the printed digits' 2e-6
INDEXER_LOSS_RTOL = 2e-5
# the recipe whose host run calls every fused DSA op (fake_dsa_ops.OPS); the other two
# recipes' fused paths (the 16K tune's indexer, GLM-5's sparse attention) call a subset
FUSED_RECIPE = "v32-128k"


@pytest.fixture(scope="module")
def dsa_run(host_sources, tmp_path_factory):
    """run(name, case, cp, laga, without=()): one loop of a DSA recipe, each name once (the
    fine-tune data is tune_data's shared build, GLM-5's documents real_loop's)."""
    require_loop_modules()
    workdir = tmp_path_factory.mktemp("dsa-loop")
    ready, runs = {}, {}

    def run(name, case, cp, laga, without=()):
        if name not in runs:
            kind = "sft" if dsa_loop.RECIPES[case].sft else "pretrain"
            if kind not in ready:
                if kind == "sft":
                    require_tune_modules()
                ready[kind] = dsa_loop.prepare(host_sources, workdir, case)
            llm = Path(ready[kind]["sources"]["MINDSPEED_LLM_SRC"])
            argv = dsa_loop.recipe(llm, case, cp, laga, ready[kind]["data"], without=without)
            runs[name] = dsa_loop.run(ready[kind], workdir / name, case, argv,
                                      timeout_s=RUN_TIMEOUT_S)
        return runs[name]

    return run


def require_tune_modules():
    """What the host's instruction data needs (test_real_tune's TUNE_MODULES but peft: no
    LoRA here); as host_sources does: skip naming them, fail under CI=true."""
    import importlib.util
    missing = [name for name in ("datasets", "tokenizers")
               if importlib.util.find_spec(name) is None]
    if missing:
        from support.thirdparty import skip_or_fail
        skip_or_fail(f"the DSA tune recipes need: pip install {' '.join(missing)}")


def assert_host_ran(run):
    losses = run.series("lm loss")
    assert max(losses) - min(losses) > 1e-3, f"the losses do not move: {losses}"
    for rank, counts in enumerate(run.counts):
        assert counts.get("laga_sparse_attention", 0) == 0, counts
        assert counts["core_attention"] == counts["mla_forward"] > 0, f"rank {rank}: {counts}"


def assert_laga_on_every_mla(run, ref):
    """LAGA's sparse attention on every MLA forward, as many as the CP 1 run made."""
    layers = int(real_loop.flag_value(run.argv, "--num-layers"))
    expected = ref.counts[0]["mla_forward"]
    assert expected >= layers * real_loop.MICRO_BATCHES * real_loop.ITERATIONS, ref.counts
    for rank, counts in enumerate(run.counts):
        where = f"rank {rank}: {counts}"
        assert counts.get("core_attention", 0) == 0, "the host's core attention ran: " + where
        assert counts["laga_sparse_attention"] == counts["mla_forward"] == expected, where


def assert_same_indexer_loss(run, ref):
    """The printed indexer loss (the tracker's mean over layers and CP ranks), every
    iteration."""
    for i, printed in ref.printed.items():
        want, got = printed[INDEXER_LOSS], run.printed[i][INDEXER_LOSS]
        assert want > 0 and abs(got - want) <= INDEXER_LOSS_RTOL * want, (i, got, want)


@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
@pytest.mark.parametrize("case", list(dsa_loop.RECIPES))
def test_dsa_recipe_equals_cp1(dsa_run, case):
    without = dsa_loop.NON_FUSED[case]
    ref = dsa_run(f"{case}-cp1-non-fused", case, 1, False, without=without)
    assert_host_ran(ref)
    run = dsa_run(f"{case}-laga-non-fused", case, dsa_loop.RECIPES[case].cp, True,
                  without=without)
    assert_laga_on_every_mla(run, ref)
    assert_same_training(run, ref)
    assert_same_indexer_loss(run, ref)


@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_host_fused_recipe_trains(dsa_run):
    """The 128K tune as shipped (its fused flags) trains at CP 1 on the fused ops'
    stand-ins, each op called on every MLA forward."""
    ref = dsa_run("fused-cp1", FUSED_RECIPE, 1, False)
    assert_host_ran(ref)
    assert all(INDEXER_LOSS in printed for printed in ref.printed.values()), ref.printed
    forwards = ref.counts[0]["mla_forward"]
    for op in fake_dsa_ops.OPS:
        assert ref.counts[0].get(op, 0) >= forwards, (op, ref.counts[0])

"""The host's DeepSeek-V3 128k recipe through MindSpeed-LLM's own ``pretrain_gpt.py``, with LAGA.

The recipe (``tests/poc/``, read by tests/support/loop/long_recipe.py) scaled down as the
stock one is: ``--reset-attention-mask --attention-mask-type general
--fix-sub-seq-length`` (64 tokens in documents of 12, ends inside the CP ranks' slices),
``--shape-order BNSD``, ``--mla-mm-split``, ``--mla-fa-without-pad``, full recompute and
``--transformer-impl transformer_engine`` (MindSpeed's TE modules, which run on CPU as
they are: tests/support/loop/te_modules.py).

Each case trains at CP 4 with ``--mla-latent-all-gather`` and must equal, iteration by
iteration within the loop tolerances (tests/support/loop/compare.py), the host's own run of
the recipe as shipped: CP 4 ``ulysses_cp_algo`` without the flag (MindSpeed's Ulysses
attention on the strict ``npu_fusion_attention`` stand-in, documents from
``actual_seq_len``):

- ``ulysses_cp_algo``, the recipe's own;
- ``megatron_cp_algo`` and ``hybrid_cp_algo`` (U 2), the other algorithms MindSpeed-LLM
  accepts with ``general`` (it refuses ``kvallgather_cp_algo`` there). Both cut the batch
  and the positions contiguously under ``general`` (their ``_general`` splitters); the
  host's own CP attention for them fails on MLA's 4-D tensors at the first forward
  (``dot_product_attention.py`` rearranges them as packed 3-D ones), so the Ulysses run is
  the host's run of this model.

Why not CP = 1: under ``--transformer-impl transformer_engine`` at CP = 1 MindSpeed-LLM
replaces ``TEDotProductAttention`` by its ``CustomDotProductAttention``, whose softmax scale
is ``1/sqrt(kv_channels)`` (0.25 here) instead of MLA's ``1/sqrt(q_head_dim)`` x yarn's
mscale^2 (0.382, which its CP attention uses): the host's CP = 1 run is another model
(docs/INTEGRATION.md, "General masks and fixed sub-sequences").

Measured (4 iterations): each case against the reference, losses equal, grad norms within
2.1e-7 relative; the host's CP = 1 run differs from its CP 4 run by 1.3e-4 (losses) and
2.7e-3 (grad norm). Mutants tried by hand, each failing both tolerances: LAGA's softmax
scale 1% off (ulysses: 6.0e-5 / 3.5e-4) and every document end one token late
(megatron: 2.0e-3 / 2.8e-2).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from support.loop import long_recipe, real_loop
from support.loop.compare import (RUN_TIMEOUT_S, assert_ran, assert_same_training,
                                  require_loop_modules)
from support.loop.te_modules import assert_te_modules_ran

pytestmark = [pytest.mark.ascend, pytest.mark.loop, pytest.mark.hosts]

CP = 4
CASES = {
    "ulysses_cp_algo": dict(cp_algo="ulysses_cp_algo"),
    "megatron_cp_algo": dict(cp_algo="megatron_cp_algo"),
    "hybrid_cp_algo-u2": dict(cp_algo="hybrid_cp_algo", ulysses_degree=2),
}


@pytest.fixture(scope="module")
def long_loop(host_sources, tmp_path_factory):
    """run(name, cp, laga, cp_algo=..., **recipe): one loop of the scaled-down 128k recipe,
    each name once."""
    require_loop_modules()

    def argv_for(ready, cp, laga, cp_algo="ulysses_cp_algo", **recipe):
        argv = long_recipe.recipe(Path(ready["sources"]["MINDSPEED_LLM_SRC"]), cp, cp_algo,
                                  laga, ready["data_path"], **recipe)
        return argv, real_loop.ranks(argv)

    return real_loop.memoized_runs(host_sources, tmp_path_factory.mktemp("long-recipe"),
                                   argv_for, RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def reference(long_loop):
    """The host's own CP 4 run of the recipe (ulysses, no flag)."""
    ref = long_loop("host-ulysses", CP, laga=False)
    assert_ran(ref, laga=False)
    assert_te_modules_ran(ref)
    losses = ref.series("lm loss")
    assert max(losses) - min(losses) > 1e-3, f"the losses do not move: {losses}"
    return ref


@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
@pytest.mark.parametrize("case", list(CASES))
def test_long_recipe_equals_the_hosts_run(long_loop, reference, case):
    run = long_loop(case, CP, laga=True, **CASES[case])
    assert_ran(run, laga=True)
    assert_te_modules_ran(run)
    assert_same_training(run, reference)

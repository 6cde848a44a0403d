"""LAGA's sparse form through MindSpeed-LLM 26.1.0's FSDP2 backend: the host's own GLM-5.2
system-test YAML (``model_id: glm52``, MindSpeed-LLM's own ``GlmMoeDsaAttention``) shrunk
to a 3-layer model (DSA with 8 picks of 32 keys, a layer that computes its picks and one
that shares them, MoE), on gloo CPU ranks under FSDP2 (tests/support/fsdp2/loop.py).

LAGA at CP 2 (``--parallel.mla_latent_all_gather true``) must train as the host's own CP 1
run does, step by step, within the DeepSeek-V3 cases' tolerances
(tests/support/fsdp2/compare.py). Both runs order top-k ties by position (the indexer's
ReLU scores tie at 0 across the k-th pick; loop.POSITION_ORDERED_TOPK). Measured: step 1
equal (loss 0, grad norm 6.4e-8), step 2 6.9e-7 and 6.9e-6. The runs stop after two steps:
at step 3 an index score near a tie crosses it in fp32 and one pick differs (loss 2.4e-5,
grad norm 8.4e-4; ``python tests/support/fsdp2/loop.py --model glm52 --cp 2 --cp-type ring
--laga``). Ring's chunks read as contiguous slices (layout ``contiguous`` for ``zigzag``)
fail it at step 1 (loss 1.9e-3). On a CPU tensor the host's GLM-5.2 takes its torch path,
which computes no indexer loss (only its fused NPU path does): the logged indexer loss is
absent on both sides, and tests/mindspeed/test_fsdp2_glm_dsa.py compares it on the module.

The host's own CP is no reference here: its table replaces transformers'
``GlmMoeDsaAttention.forward`` while ``model_id: glm52`` builds MindSpeed-LLM's own class,
so at CP 2 every rank attends its own slice only (against its CP 1, step 1's loss moves by
1.6e-3 and its grad norm by 1.5e-2: ``python tests/support/fsdp2/loop.py --model glm52 --cp 2``).

After the first step every later layer call does one all-gather of ``[latent | rope |
index key]`` (``[latent | rope]`` on the shared layer) and no host read; its backward one
reduce-scatter.
"""
from __future__ import annotations

import pytest

from support.fsdp2 import loop
from support.fsdp2.compare import MICRO_BATCHES, assert_ran, assert_same_training
from support.loop.compare import RUN_TIMEOUT_S, require_loop_modules
from support.loop.steady_state import assert_steady_state
from support.thirdparty import fsdp2_sources

pytestmark = [pytest.mark.ascend, pytest.mark.loop, pytest.mark.hosts]
LAYERS = 3
STEPS = 2
SHORT = ["--training.max_steps", str(STEPS)]


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    require_loop_modules()
    return loop.runner(fsdp2_sources(), tmp_path_factory.mktemp("fsdp2-glm"), RUN_TIMEOUT_S,
                       model="glm52")


def test_glm52_laga_cp2_equals_host_cp1(glm):
    ref = glm("host-cp1", overrides=SHORT)
    run = glm("laga-cp2-ring", cp=2, cp_type="ring", laga=True, overrides=SHORT)
    assert_ran(run, laga=True, layers=LAYERS, counter="laga_sparse_attention", steps=STEPS)
    assert_same_training(run, ref, cp=2, steps=STEPS)
    assert run.indexer_losses == ref.indexer_losses == [None] * STEPS
    assert_steady_state(run, MICRO_BATCHES, STEPS, data="allgather")
    dims = loop.GLM52
    latent = dims["kv_lora_rank"] + dims["qk_rope_head_dim"]
    assert run.values_per_token("all_gather", loop.SEQ_LENGTH // 2) == \
        {latent + dims["index_head_dim"], latent}


def test_glm52_laga_cp4_ulysses_equals_host_cp1(glm):
    """CP 4 under ``ulysses`` (one head a rank, contiguous slices of 8 tokens): the same
    training as the host's CP 1 run, the same gathers per token. The host's contiguous
    slices read as zigzag (``glm_dsa.LAYOUTS``) fail it at step 1 (loss 2.3e-3)."""
    ref = glm("host-cp1", overrides=SHORT)
    run = glm("laga-cp4-ulysses", cp=4, cp_type="ulysses", laga=True, overrides=SHORT)
    assert_ran(run, laga=True, layers=LAYERS, counter="laga_sparse_attention", steps=STEPS)
    assert_same_training(run, ref, cp=4, steps=STEPS)
    dims = loop.GLM52
    latent = dims["kv_lora_rank"] + dims["qk_rope_head_dim"]
    assert run.values_per_token("all_gather", loop.SEQ_LENGTH // 4) == \
        {latent + dims["index_head_dim"], latent}

"""Steady state of MindSpeed-LLM's real ``CustomMLASelfAttention`` under LAGA, at CP = 2.

Three layers of the real module called in a chain through LAGA's patched forward, then
backward, three micro-batches in a row (harness: tests/support/steady_state_real.py). On
the third micro-batch (every module past its first, warm-up call):

- the micro-batch's first layer call exchanges the ranks' agreement once (one small int64
  all-reduce), and its data collectives;
- every later layer call: exactly its data collectives forward (the latent's all-gather;
  ulysses adds its all-to-alls of Q and O), no other collective, and no host read;
- LAGA's backward: each layer's adjoint data collectives (the reduce-scatter, ulysses'
  all-to-alls), no other collective and no host read;
- nothing LAGA runs outside its forward and backward.

Without a mask, with the SFT trainer's padding mask (right and left), and with LoRA on
the K/V up-projection (peft: CI's Ascend leg). A per-layer ``.item()`` put in the adapter
is seen on every layer call (``test_a_per_layer_read_in_the_adapter_is_seen``), so a
steady-state check above fails on it.
"""
import os

import pytest

pytestmark = pytest.mark.ascend

STEADY = 2  # the third micro-batch


@pytest.fixture(scope="module")
def harness(host_sources):
    os.environ.update(host_sources)
    from support import steady_state_real
    return steady_state_real


@pytest.fixture(scope="module")
def counted(harness):
    return harness.run(harness.CASES)


def _check_steady(harness, name, argv, per_rank):
    algo = argv[argv.index("--context-parallel-algo") + 1]
    forward, backward = harness.expected_data(algo)
    for rank, results in enumerate(per_rank):
        counts = results[name][STEADY]
        where = f"{name}, rank {rank}: {counts}"
        first = counts["laga.forward.0"]
        exchanges = [tuple(c) for c in first["collectives"] if c[1] == "int64"]
        assert exchanges == [("all_reduce", "int64")], where
        assert sorted(k for k, dtype in first["collectives"] if dtype != "int64") == forward, where
        for layer in range(1, harness.LAYERS):
            call = counts[f"laga.forward.{layer}"]
            assert sorted(k for k, _ in call["collectives"]) == forward, (layer, where)
            assert all(dtype == "float32" for _, dtype in call["collectives"]), (layer, where)
            assert call["syncs"] == {}, (layer, where)
        assert sorted(k for k, _ in counts["laga.backward"]["collectives"]) == \
            sorted(backward * harness.LAYERS), where
        assert counts["laga.backward"]["syncs"] == {}, where
        assert counts["outside"]["collectives"] == [], where


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["plain-kvallgather", "plain-megatron", "plain-ulysses",
                                  "sft-right-megatron", "sft-left-kvallgather"])
def test_steady_state_of_the_real_module(harness, counted, name):
    _check_steady(harness, name, harness.CASES[name][0], counted)


@pytest.mark.hosts
@pytest.mark.timeout(900)
def test_steady_state_with_lora_on_the_kv_up_projection(harness):
    from support.thirdparty import require_peft
    require_peft()
    per_rank = harness.run(harness.LORA_CASES)
    for name, (argv, _, _) in harness.LORA_CASES.items():
        _check_steady(harness, name, argv, per_rank)


@pytest.mark.timeout(900)
def test_a_per_layer_read_in_the_adapter_is_seen(harness):
    """The mutant: one ``.item()`` per layer call in ``laga_self_attention``; every layer
    call's forward then counts it, so the steady-state checks fail on it."""
    name = "plain-kvallgather"
    per_rank = harness.run({name: harness.CASES[name]}, mutant=True)
    for results in per_rank:
        for counts in results[name]:
            for layer in range(harness.LAYERS):
                assert counts[f"laga.forward.{layer}"]["syncs"].get("Tensor.item", 0) >= 1, counts
    with pytest.raises(AssertionError):
        _check_steady(harness, name, harness.CASES[name][0], per_rank)

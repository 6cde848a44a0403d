"""The megatron-core patch with a peft LoRA adapter on ``linear_kv_up_proj``.

peft's ``LoraParallelLinear`` wraps megatron-core's local-spec ``ColumnParallelLinear``
as it wraps MindSpeed-LLM's (``LoraConfig(megatron_config=..., megatron_core=
"megatron.core")``; the TE spec's fused ``TELayerNormColumnParallelLinear`` is no
megatron ``ColumnParallelLinear``, so peft refuses to wrap it and LAGA never meets
it). The tiny MLA GPT of mindspeed_laga/tools/megatron_cpu.py gets adapters on
``linear_kv_up_proj`` and ``linear_q_up_proj`` with non-zero ``lora_B``, every weight
trainable, and trains 3 SGD steps: LAGA at CP = 2 (allgather on zigzag batches,
ulysses on contiguous ones) against megatron's own forward at CP = 1, and at
TP = 2 x CP = 2 against megatron's own TP = 2 run; losses and every grad, the
adapters' included. peft is in CI's Ascend leg only (with megatron-core 0.16.1):
``hosts`` tests, skipped without peft, failed under ``CI=true``.
"""
from __future__ import annotations

import warnings

import pytest

pytest.importorskip("megatron.core")
from mindspeed_laga.tools import megatron_cpu as mc  # noqa: E402
from support.thirdparty import require_peft  # noqa: E402

from mindspeed_laga.tools.spawn import WorkerError, run_on_ranks  # noqa: E402
from support.megatron_training import STEPS, assert_same_training  # noqa: E402

pytestmark = [pytest.mark.ascend, pytest.mark.hosts]

TINY = mc.TinyMLA()
TARGETS = ["linear_kv_up_proj", "linear_q_up_proj"]
PATCHED = {"laga-allgather": (dict(cp_algo="allgather"), "zigzag"),
           "laga-ulysses": (dict(cp_algo="ulysses", layout="contiguous"), "contiguous")}


def _with_lora(model):
    """peft's LoRA on TARGETS, every weight (base and adapter) set by name and trainable."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0,
                        bias="none", megatron_config=model.config, megatron_core="megatron.core")
    get_peft_model(model, config)  # wraps the targets of ``model`` in place
    from megatron.core import parallel_state
    mc.set_weights_by_name(model, parallel_state.get_tensor_model_parallel_world_size())
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def _run(name, results, tp, cp, patch=None, layout="zigzag"):
    import mindspeed_laga
    if patch is None:
        mindspeed_laga.unpatch_megatron_mla()
    else:
        mindspeed_laga.patch_megatron_mla(**patch)
    model = _with_lora(mc.build_tiny_mla_gpt(TINY, tp=tp, cp=cp))
    wrapped = type(model.decoder.layers[0].self_attention.linear_kv_up_proj).__name__
    res = mc.train(model, mc.make_batches(TINY, STEPS), layout=layout, tp=tp)
    results[name] = dict(losses=res.losses, grads=res.grads, wrapped=wrapped)


def _worker(rank, size, world):
    warnings.filterwarnings("ignore", message=".*Apex.*")
    results = {}
    if world == 1:
        mc.init_parallel(cp=1)
        _run("reference", results, 1, 1)
    elif world == 2:
        mc.init_parallel(cp=2)
        for name, (patch, layout) in PATCHED.items():
            _run(name, results, 1, 2, patch, layout)
    else:
        mc.init_parallel(tp=2, cp=1)  # DP = 2, both replicas see the same batch
        _run("tp2-megatron", results, 2, 1)
        mc.init_parallel(tp=2, cp=2)
        _run("tp2/laga-allgather", results, 2, 2, *PATCHED["laga-allgather"])
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def worlds():
    require_peft()
    try:
        return {size: run_on_ranks(_worker, size, size, timeout_s=600)[0] for size in (1, 2, 4)}
    except WorkerError as exc:
        raise AssertionError(f"a world failed:\n{exc}") from exc


def test_the_adapter_is_in_the_model(worlds):
    """peft wrapped the module, and the adapter moves the loss: the reference is not the
    same model without it (non-zero lora_B), and lora_A/lora_B get grads."""
    ref = worlds[1]["reference"]
    assert ref["wrapped"] == "LoraParallelLinear"
    for part in ("lora_A", "lora_B"):
        key = f"decoder.layers.0.self_attention.linear_kv_up_proj.{part}.default.weight"
        assert ref["grads"][key].abs().max() > 1e-3, key


@pytest.mark.parametrize("name", PATCHED)
def test_cp2_matches_megatron_cp1(worlds, name):
    assert_same_training(worlds[2][name], worlds[1]["reference"], f"LoRA, CP=2 {name}")


def test_tp2_cp2_matches_megatron_tp2(worlds):
    assert_same_training(worlds[4]["tp2/laga-allgather"], worlds[4]["tp2-megatron"],
                          "LoRA, TP=2 x CP=2 laga-allgather")

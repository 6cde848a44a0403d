"""LoRA on the K/V up-projection of MindSpeed-LLM's real ``CustomMLASelfAttention``.

A LoRA adapter on ``linear_kv_up_proj`` (or ``linear_kv_nope`` + ``linear_v`` with
``--mla-mm-split``) lives in the wrapped module's forward, which LAGA does not call:
it rebuilds K/V from the module's effective weight instead (patches/lora.py). Here
peft 0.7.1 adapters with non-zero ``lora_B`` are added as MindSpeed-LLM adds them
(its ``LoraParallelLinearMoE``, CCLoRA's forward with ``--lora-fusion``) or as peft
alone does, and LAGA at CP = 2 (kvallgather, ulysses, megatron; TP = 2 with and
without sequence parallelism) is compared with the module's own forward at CP = 1
on the full sequence: output, hidden-states grad and every trainable parameter's
grad, ``lora_A``/``lora_B`` included (harness: tests/support/lora_real.py).

peft is installed in CI's Ascend leg only, so these are ``hosts`` tests; without
peft they skip, and fail under ``CI=true``.
"""
import os

import pytest

from mindspeed_laga.patches.mindspeed_llm.releases import BY_NAME
from support.thirdparty import require_peft

pytestmark = [pytest.mark.ascend, pytest.mark.hosts]

TOLERANCE = 1e-5  # float32, relative to the largest reference magnitude


@pytest.fixture(scope="module")
def lora_hosts(host_sources):
    require_peft()
    os.environ.update(host_sources)
    from support import lora_real
    return lora_real


@pytest.fixture(scope="module")
def runs(lora_hosts):
    """Every case at CP = 1 and 2 (TP = 1); the TP cases at TP = 2, CP = 1 and 2, with and
    without sequence parallelism (three spawns: the world sizes 1, 2, 4)."""
    lr = lora_hosts
    tp_cases = {name: lr.CASES[name] for name in lr.TP_CASES}
    tp_cases_no_sp = {**tp_cases, **lr.TP_CCLORA_CASES}
    one = lr.run_jobs(1, [(1, False, {**lr.CASES, **lr.TP_CCLORA_CASES})])
    two = lr.run_jobs(2, [(1, False, lr.CASES), (2, False, tp_cases_no_sp)])
    four = lr.run_jobs(4, [(2, False, tp_cases_no_sp), (2, True, tp_cases)])
    return dict(reference=one[0], cp2=two[0], tp2=two[1], tp2_cp2=four[0], tp2_sp_cp2=four[1])


def _check(lr, got, ref, label):
    assert got["param_grads"].keys() == ref["param_grads"].keys(), label
    assert any("lora_A" in k for k in ref["param_grads"]), label
    error = lr.max_relative_error(got, ref)
    assert error <= TOLERANCE, f"{label}: max relative error {error:.3e}"


CASE_NAMES = ("moe-fused-kvallgather", "moe-mmsplit-ulysses", "cclora-fused-ulysses",
              "cclora-mmsplit-megatron", "peft-fused-megatron-alltrained")


def test_the_case_list_is_the_harness_list(lora_hosts):
    assert tuple(lora_hosts.CASES) == CASE_NAMES


@pytest.mark.parametrize("name", CASE_NAMES)
def test_cp2_equals_the_wrapped_module_at_cp1(lora_hosts, runs, name):
    lr = lora_hosts
    _check(lr, lr.assemble(runs["cp2"], name), lr.assemble(runs["reference"], name),
           f"{name}: LAGA CP=2 vs the module at CP=1")


@pytest.mark.parametrize("name", CASE_NAMES)
def test_the_adapters_are_the_hosts_classes(runs, name):
    """The modules are wrapped by the classes and forwards the case names."""
    first = runs["cp2"][0][name]
    kv = ("linear_kv_nope", "linear_v") if "mmsplit" in name else ("linear_kv_up_proj",)
    expected_class = "LoraParallelLinear" if name.startswith("peft") else "LoraParallelLinearMoE"
    expected_forward = ("CCLoraParallelLinearForward" if name.startswith("cclora")
                        else f"{expected_class}.forward")
    for module in kv:
        assert first["wrapped"][module] == expected_class, first["wrapped"]
        assert first["forwards"][module] == expected_forward, first["forwards"]


@pytest.mark.parametrize("name", ("moe-fused-kvallgather", "moe-mmsplit-ulysses",
                                  "cclora-fused-kvallgather-kvonly"))
def test_tp2_cp2_equals_the_wrapped_module_at_tp2_cp1(lora_hosts, runs, name):
    """Without sequence parallelism the reference is the module at the same TP (its rope
    key grad is partial per TP rank, see mindspeed_llm_real.check_numerics)."""
    lr = lora_hosts
    _check(lr, lr.assemble(runs["tp2_cp2"], name), lr.assemble(runs["tp2"], name),
           f"{name}: LAGA TP=2 CP=2 vs the module at TP=2 CP=1")


@pytest.mark.parametrize("name", ("moe-fused-kvallgather", "moe-mmsplit-ulysses"))
def test_tp2_sp_cp2_equals_the_wrapped_module_at_cp1(lora_hosts, runs, name):
    lr = lora_hosts
    _check(lr, lr.assemble(runs["tp2_sp_cp2"], name), lr.assemble(runs["reference"], name),
           f"{name}: LAGA TP=2 SP CP=2 vs the module at TP=CP=1")


def test_tp2_without_sp_gives_every_tp_rank_the_whole_lora_a_grad(lora_hosts, runs):
    """lora_A is replicated over TP and, without SP, the forward all-reduces its grad: every
    TP rank holds the whole grad (summed over CP, as Megatron does), as at TP = 2, CP = 1."""
    import torch
    name, key = "moe-fused-kvallgather", "linear_kv_up_proj.lora_A.default.weight"
    reference = {r[name]["tp_rank"]: r[name]["run"]["param_grads"][key] for r in runs["tp2"]}
    per_tp_rank = {}
    for r in runs["tp2_cp2"]:
        per_tp_rank.setdefault(r[name]["tp_rank"], []).append(r[name]["run"]["param_grads"][key])
    assert sorted(per_tp_rank) == [0, 1]
    for tp_rank, grads in per_tp_rank.items():
        ref = reference[tp_rank]
        assert torch.allclose(sum(grads), ref, rtol=0, atol=TOLERANCE * ref.abs().max()), tp_rank


def test_startup_refusals_through_each_releases_parser(release_host_sources):
    """LoRA on the K/V up-projection validates with every release's real argument
    pipeline; --qlora (2.2.0 to 26.0.0) and LU-LoRA on those modules are refused at
    validation, naming the flag (tests/support/lora_real.py, check_refusals)."""
    import subprocess
    import sys
    from pathlib import Path
    release, sources = release_host_sources
    script = Path(__file__).resolve().parents[1] / "support" / "lora_real.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=dict(os.environ, **sources), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    # the host shows facts, not a name: a release with another's facts is identified as it
    assert f"facts: {BY_NAME[release].facts()}\nrefusals: ok" in proc.stdout, proc.stdout[-4000:]
    from support.lora_real import WITH_QLORA
    assert ("--qlora: refused" in proc.stdout) == (BY_NAME[release].facts_owner in WITH_QLORA)

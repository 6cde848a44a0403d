"""LAGA under FP8 (``--fp8-format e4m3 --fp8-recipe mxfp8``) on MindSpeed's real TE linear:
K/V rebuilt through the module's own FP8 matmul equal the host's CP = 1 FP8 run as closely
as the host's own CP > 1 run does; a rebuild without FP8 (the wrong precision) and a 1%
softmax-scale error both fail the same tolerance (tests/support/fp8_rebuild.py); and the
MindSpeed-LLM adapter's wrapped forward does the same end to end. float32 activations, so
LAGA's own sums stay below 1e-6 and any FP8 difference shows."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# a real-module comparison of tens of seconds, with peft for its LoRA check: the Ascend leg
# only (tests/conftest.py)
pytestmark = [pytest.mark.ascend, pytest.mark.hosts]
SCRIPT = Path(__file__).resolve().parents[1] / "support" / "fp8_rebuild.py"

TOLERANCE = 1e-5  # relative to the largest reference magnitude (measured: <= 2.5e-7)
TENSORS = ("output", "query", "kv_latent", "k_pos_emb", "weight")


@pytest.fixture(scope="module")
def errors(host_sources):
    """In a process of its own: the host's Megatron and MindSpeed first on its path (and its
    ranks' fork server's), ahead of an installed megatron-core another test imported."""
    path = os.pathsep.join([host_sources["MEGATRON_SRC"], host_sources["MINDSPEED_SRC"],
                            os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(SCRIPT), "2", "float32", "--json"],
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, **host_sources, PYTHONPATH=path))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_host_cp2_equals_its_cp1(errors):
    assert max(errors["host_cp"].values()) < TOLERANCE, errors["host_cp"]


def test_laga_fp8_rebuild_equals_the_host_cp1(errors):
    assert max(errors["laga_fp8"].values()) < TOLERANCE, errors["laga_fp8"]
    assert errors["laga_fp8"]["output"] <= 10 * errors["host_cp"]["output"] + 1e-7


@pytest.mark.parametrize("mutant", ["laga_bf16_rebuild", "laga_fp8_scale_1pct"])
def test_wrong_precision_and_scale_fail(errors, mutant):
    assert errors[mutant]["output"] > 100 * TOLERANCE, errors[mutant]
    assert all(errors[mutant][name] > TOLERANCE for name in TENSORS), errors[mutant]


def test_fp8_matters_here(errors):
    """The comparison is about FP8: the host's FP8 run is far from its bf16-free one."""
    assert errors["fp8_vs_no_fp8"]["output"] > 1e-2


def test_adapter_wrapped_forward_equals_the_original_at_cp1(errors):
    """forward.py's wrapped forward at CP 2 (LAGA, the module's FP8 rebuild) against the
    stand-in MLA's original forward at CP 1, both in FP8: output, hidden-states grad and
    every parameter grad (summed over CP)."""
    adapter = errors["adapter"]
    assert adapter["laga_ran"]
    assert "linear_kv_up_proj.weight" in adapter["errors"]
    assert max(adapter["errors"].values()) < TOLERANCE, adapter["errors"]


def test_lora_under_fp8(errors):
    """peft refuses to wrap MindSpeed's TE linear (so under FP8 the K/V module's effective
    weight is its own); a wrapped FP8 K/V module raises naming it."""
    refused = errors["peft_wraps_te_linear"]
    if refused is None:
        pytest.skip("peft is not installed")
    assert "not supported" in refused and "TEColumnParallelLinear" in refused
    assert "linear_kv_up_proj is a LoRA-wrapped FP8 linear" in errors["wrapped_fp8_module"]

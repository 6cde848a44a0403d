"""The FP8 twin in MindSpeed-LLM's real training loop: the scaled-down stock DeepSeek-V3 recipe
with ``--transformer-impl transformer_engine --fp8-format e4m3 --fp8-recipe mxfp8`` (every
linear is MindSpeed's FP8 ``TEColumnParallelLinear``/``TERowParallelLinear``, its MX ops from
tests/support/fake_npu_quant.py), LAGA at CP 4 ulysses against the host's CP 1 FP8 run.

What the loop can and cannot resolve under FP8 (measured, docs/INTEGRATION.md "FP8"): an
e4m3 value has 3 mantissa bits, so a difference of 1e-7 anywhere upstream of a quantization
(LAGA's attention against the host's) flips a rounding now and then and moves an activation
by 1/16. LAGA's first loss (the forward of the initial weights) is 2.4e-5 from the host's;
the K/V rebuild in the wrong precision (bf16, no FP8) moves it 1.0e-4 and fails the bound
below, a 1% softmax-scale error (2.5e-5) does not: tests/mindspeed/test_fp8_rebuild.py
resolves both on one module in float32. Later iterations are bounded loosely: the host's own
CP 4 FP8 run differs from its CP 1 run by up to 3.5e-5 (losses) and 5.9e-3 (grad norms),
since FP8's weight gradients quantize blocks of 32 tokens that the CP split regroups.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from support.loop import real_loop
from support.loop.compare import RUN_TIMEOUT_S, require_loop_modules
from support.loop.fp8 import FP8, HEAD_DIMS, assert_trained_in_fp8, assert_within

pytestmark = [pytest.mark.ascend, pytest.mark.loop, pytest.mark.hosts]

FIRST_LOSS = 5e-5    # measured 2.4e-5; the bf16 rebuild 1.0e-4
LOSSES = 5e-4        # measured 1.6e-4 (the host's own CP 4: 3.5e-5)
GRAD_NORMS = 2e-2    # measured 5.9e-3 (the host's own CP 4: 5.9e-3)


@pytest.fixture(scope="module")
def runs(host_sources, tmp_path_factory):
    require_loop_modules()
    workdir = tmp_path_factory.mktemp("real-loop-fp8")
    ready = real_loop.prepare(host_sources, workdir, real_loop.default_documents())
    llm_src = Path(ready["sources"]["MINDSPEED_LLM_SRC"])
    out = {}
    for name, cp in (("cp1", 1), ("laga-cp4", 4)):
        argv = real_loop.recipe(llm_src, cp, "ulysses_cp_algo", True, ready["data_path"],
                                extra=FP8, layout=HEAD_DIMS)
        out[name] = real_loop.run_loop(ready["sources"], workdir / name, cp, argv,
                                       timeout_s=RUN_TIMEOUT_S)
    return out


@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
def test_fp8_loop_trained_fp8_with_laga(runs):
    for name, run in runs.items():
        assert_trained_in_fp8(run, name)
        for rank, counts in enumerate(run.counts):
            where = f"{name} rank {rank}: {counts}"
            laga = counts.get("laga_attention", 0)
            assert laga == (counts["mla_forward"] if name != "cp1" else 0), where
            host_attention = counts["mla_forward"] if name == "cp1" else 0
            assert counts.get("core_attention", 0) == host_attention, where


@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
def test_fp8_loop_equals_cp1_as_far_as_fp8_resolves(runs):
    assert_within(runs["laga-cp4"], runs["cp1"], FIRST_LOSS, LOSSES, GRAD_NORMS)

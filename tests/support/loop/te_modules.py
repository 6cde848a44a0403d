"""MindSpeed's own Transformer-Engine modules (``mindspeed/te/pytorch/``) in the real loop.

Under ``--transformer-impl transformer_engine`` without FP8, MindSpeed-LLM (its
``TransformerEngineBasicFeature``) maps Megatron's ``TEColumnParallelLinear`` and
``TERowParallelLinear`` to Megatron's own ``ColumnParallelLinear`` and
``RowParallelLinear`` (so MLA's projections are those layers, as under ``local``) and builds
the dense MLP's first projection from MindSpeed's
``MindSpeedTELayerNormColumnParallelLinear`` (``mindspeed/te/pytorch/module/``); only with
``--fp8-format`` does it patch in MindSpeed's ``TEColumnParallelLinear`` and
``TERowParallelLinear``. Without FP8 these modules compute with torch matmuls, which run on
CPU as they are; their NPU-only parts sit behind flags the scaled-down recipes drop
(``--use-fused-rmsnorm``: ``npu_rms_norm``; ``--moe-grouped-gemm``: ``npu_grouped_matmul``
in ``MindSpeedTEGroupedLinear``; ``--gemm-gradient-accumulation-fusion``:
``npu_matmul_add_fp32``), so no stand-in replaces any part of them.

The loop bootstrap counts every forward of a module defined under ``mindspeed.te.pytorch``
as ``te:<class name>`` (:func:`count`), so a test can show that MindSpeed's TE modules
trained (:func:`assert_te_modules_ran`).
"""
from __future__ import annotations

from typing import Iterable

TE_PACKAGE = "mindspeed.te.pytorch."
PREFIX = "te:"
# MindSpeed's TE modules a bf16 (no FP8) DeepSeek-V3 recipe trains with
BF16_TE_MODULES = ("MindSpeedTELayerNormColumnParallelLinear",)


def count(module, counts) -> None:
    """Count one forward of ``module`` if it is one of MindSpeed's TE modules."""
    cls = type(module)
    if cls.__module__.startswith(TE_PACKAGE):
        counts[PREFIX + cls.__name__] += 1


def te_counts(counts: dict) -> dict:
    """{class name: forwards} of one rank's counters."""
    return {k[len(PREFIX):]: v for k, v in counts.items() if k.startswith(PREFIX)}


def assert_te_modules_ran(run, classes: Iterable[str] = BF16_TE_MODULES) -> None:
    """Every rank ran forwards of each of ``classes`` (MindSpeed's TE modules)."""
    for rank, counts in enumerate(run.counts):
        ran = te_counts(counts)
        missing = [name for name in classes if not ran.get(name)]
        assert not missing, f"rank {rank} ran no {missing} forward (TE modules: {ran})"

"""What the real-loop FP8 cases share: the twin's flags and how a run is checked under FP8
(tests/loop/test_long_recipe_fp8.py)."""
from __future__ import annotations

from support.loop import real_loop

# the recipes' FP8 twin: --fp8-format e4m3 --fp8-recipe mxfp8 on MindSpeed's TE modules
FP8 = ["--transformer-impl", "transformer_engine", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"]
HEAD_DIMS = {"--qk-head-dim": "32", "--v-head-dim": "32"}  # whole MX blocks per head


def assert_trained_in_fp8(run, name: str) -> None:
    """Every rank ran FP8 matmuls (the MX stand-in's count) in MindSpeed's TE linears."""
    for rank, counts in enumerate(run.counts):
        where = f"{name} rank {rank}: {counts}"
        assert counts.get("npu_quant_matmul", 0) > 0, where
        assert counts.get("te:TEColumnParallelLinear", 0) > 0, where


def assert_within(run, ref, first_loss: float, losses: float, grad_norms: float) -> None:
    """Relative to ``ref``: the first loss (the forward of the initial weights), every loss
    and every grad norm within their bounds."""
    def relative(key):
        return [abs(g - w) / abs(w) for g, w in zip(run.series(key), ref.series(key))]

    loss, norm = relative("lm loss"), relative("grad norm")
    assert len(loss) == len(norm) == real_loop.ITERATIONS
    assert loss[0] < first_loss, loss
    assert max(loss) < losses, loss
    assert max(norm) < grad_norms, norm

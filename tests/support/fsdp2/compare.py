"""What the FSDP2 loop modules share: the tolerances (measured on the shrunk DeepSeek-V3,
tests/loop/test_fsdp2_loop.py's docstring) and the checks that a run trained as the host's
CP 1 run did and that LAGA (or the host) ran."""
from __future__ import annotations

from support.loop.compare import LOSS_RTOL

from . import loop

FIRST_NORM_RTOL = 2e-6   # step 1: measured 0 (the host's own CP 2: 7.1e-8)
GRAD_NORM_RTOL = 3e-5    # later steps: measured 1.3e-5 (the host's own CP 2: 1.3e-5)
MICRO_BATCHES = 2  # gradient_accumulation_steps (loop.config)


def assert_same_training(run, ref, cp: int, steps: int = loop.STEPS):
    """Every step ran; losses within LOSS_RTOL of ``ref``'s, grad norms divided by ``cp``
    (the host's clip_grad_norm multiplies by the CP size) within the norm tolerances."""
    assert len(run.steps) == len(ref.steps) == steps, (run.steps, ref.steps)
    losses = [abs(g - w) / abs(w) for g, w in zip(run.losses(), ref.losses())]
    assert max(losses) <= LOSS_RTOL, f"losses {run.losses()} vs CP 1 {ref.losses()}: {losses}"
    norms = [abs(g / cp - w) / abs(w) for g, w in zip(run.grad_norms(), ref.grad_norms())]
    assert norms[0] <= FIRST_NORM_RTOL and max(norms) <= GRAD_NORM_RTOL, \
        f"grad norms / {cp} {run.grad_norms()} vs CP 1 {ref.grad_norms()}: {norms}"


def assert_ran(run, laga: bool, recompute: bool = False, layers: int = 2,
               counter: str = "laga_attention", steps: int = loop.STEPS):
    """Every rank ran each layer's attention once per micro-batch (twice with recompute:
    again in backward), all of them LAGA's (laga; ``counter``: the dense or the sparse
    form's count) or none."""
    calls = MICRO_BATCHES * steps * layers * (2 if recompute else 1)
    for rank, counts in enumerate(run.counts):
        assert counts.get("mla_forward", 0) == calls, (rank, counts)
        if laga:
            assert counts.get(counter, 0) == counts["mla_forward"], (rank, counts)
            assert counts.get("npu_fusion_attention", 0) == 0, (rank, counts)
        else:
            assert counts.get(counter, 0) == 0, (rank, counts)

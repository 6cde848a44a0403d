"""The tiny megatron-core GPT's training comparison, shared by the end-to-end and LoRA tests:
a run's losses and every parameter's grad against its reference run's, and the check that a
reference run is worth matching."""
from __future__ import annotations

import torch

STEPS = 3
LOSS_TOL = 1e-5
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)


def assert_same_training(run, ref, what):
    diffs = [abs(a - b) for a, b in zip(run["losses"], ref["losses"])]
    assert len(run["losses"]) == STEPS and max(diffs) <= LOSS_TOL, \
        f"{what}: losses {run['losses']} vs reference {ref['losses']}"
    assert run["grads"].keys() == ref["grads"].keys()
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(run["grads"][name], grad, **GRAD_TOL,
                                   msg=lambda m: f"{what}: grad of {name}: {m}")


def assert_not_degenerate(ref, what):
    """Every grad of the reference run is far from zero and each step moves its loss well
    past LOSS_TOL, so matching them means something."""
    small = [n for n, g in ref["grads"].items() if g.abs().max() < 1e-4]
    assert not small, f"{what}: near-zero grads {small}"
    losses = ref["losses"]
    assert min(abs(a - b) for a, b in zip(losses, losses[1:])) > 100 * LOSS_TOL, \
        f"{what}: losses {losses}"

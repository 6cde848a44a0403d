"""Which backward passes can be differentiated again (``create_graph=True``).

A gradient penalty differentiates the gradients themselves. Paths built from
differentiable torch ops (the eager kernels, the collectives, whose backward is
again a collective) support it exactly. A backward written by hand (the blockwise
recompute, the overlapped gather's asynchronous reduce-scatter, the fused
attention ops, whose own backward torch cannot differentiate) would return grads
detached from the inputs, and their second differentiation would silently miss
terms or give None. :func:`once_differentiable` marks such a backward: under
``create_graph=True`` it raises, naming the path and what supports it.

It raises when the backward runs rather than when its grads are differentiated
(torch's ``once_differentiable`` delays the error to a node the engine prunes
under ``torch.autograd.grad(..., inputs=...)``, so the terms would be lost
silently): a backward with ``create_graph=True`` that never differentiates again
is refused too.
"""
from __future__ import annotations

import functools

import torch

MESSAGE = ("mindspeed_laga: {what} supports one backward, not double backward "
           "(create_graph=True, e.g. a gradient penalty); {fix}")


def once_differentiable(what: str, fix: str):
    """Decorate a custom Function's ``backward``: RuntimeError naming ``what`` and ``fix``
    when it runs under ``create_graph=True`` (grad mode on inside backward)."""
    message = MESSAGE.format(what=what, fix=fix)

    def wrap(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if torch.is_grad_enabled():
                raise RuntimeError(message)
            return backward(ctx, *grads)
        return wrapper
    return wrap

"""Where LAGA's gathered latent comes from: gathered now, or by a gather started earlier.

Both sources hand out the gathered ``[kv_latent, k_pos_emb]`` of every rank
in global position order, autograd-connected (the backward reduce-scatters
its gradient). ``laga_forward`` asks for it in one of two shapes:

- ``latent(setup)``: [S, b, d_c + d_r] in one tensor (the blockwise path
  keeps exactly this for backward);
- ``parts(setup)``: (kv part [S, b, d_c], rope key [S, b, d_r]) for the
  up-projection, with no copy at all when there is no CP.

:class:`SyncLatent` gathers when asked. :class:`LatentGather` is the
overlapped source, which hides the latent all-gather behind the query
projection and its reduce-scatter behind the dq work:

Forward: :func:`start_latent_gather` is called as soon as ``kv_latent`` and
``k_pos_emb`` exist; it launches the all-gather asynchronously and returns a
:class:`LatentGather`. The caller computes the queries, then passes the handle
to ``laga_attention(..., latent_gather=handle)``, which waits only when
attention needs the latent.

Backward: the gathered latent's gradient is reduce-scattered asynchronously
by the node created *last* in forward (inside ``laga_attention``), and waited
for by a node created *first* (in ``start_latent_gather``). The autograd
engine runs ready nodes newest-first, so everything created in between (the
query projection's backward: dq work) runs while the reduce-scatter is in
flight. The blocked time of both waits is in the byte counter's ``seconds``.
"""
from __future__ import annotations

import torch

from .. import agreement, comm
from ..agreement import inband
from ..double_backward import once_differentiable
from ..kernels.precision import autocast_dtype, to_autocast
from ..vocab.attn_setup import AttnSetup
from .common import concat_latent, gathered_latent, split_latent, to_position_order


class SyncLatent:
    """Gather ``[kv_latent, k_pos_emb]`` over the CP group when the latent is needed."""

    def __init__(self, kv_latent: torch.Tensor, k_pos_emb: torch.Tensor):
        self.kv_latent, self.k_pos_emb = kv_latent, k_pos_emb

    def latent(self, setup: AttnSetup) -> torch.Tensor:
        return gathered_latent(self.kv_latent, self.k_pos_emb, setup)

    def parts(self, setup: AttnSetup):
        if setup.cp_size == 1:
            return self.kv_latent, self.k_pos_emb
        return split_latent(self.latent(setup), setup)


# ---------------------------------------------------------------- the overlapped gather

_WITHOUT_OVERLAP = "call laga_attention without latent_gather for second-order grads"


class _State:
    """What the two backward nodes share: the pending reduce-scatter."""

    def __init__(self, group):
        self.group = group
        self.pending = None


class _WaitForGradient(torch.autograd.Function):
    """Identity forward; backward waits for the reduce-scatter launched later in backward."""

    @staticmethod
    def forward(ctx, latent, state):
        ctx.state = state
        return latent.view_as(latent)

    @staticmethod
    @once_differentiable("start_latent_gather (the overlapped gather)", _WITHOUT_OVERLAP)
    def backward(ctx, grad):
        ctx.state.pending.wait()
        return grad, None


class _GatheredLatent(torch.autograd.Function):
    """Forward hands out the (already awaited) gather; backward launches the
    reduce-scatter and returns its buffer before it is filled."""

    @staticmethod
    def forward(ctx, latent, state, gathered):
        ctx.state = state
        return gathered

    @staticmethod
    @once_differentiable("start_latent_gather (the overlapped gather)", _WITHOUT_OVERLAP)
    def backward(ctx, grad):
        local, ctx.state.pending = comm.reduce_scatter_raw(grad, ctx.state.group, "backward",
                                                           "latent", async_op=True)
        return local, None, None


class LatentGather:
    """An all-gather of ``[kv_latent, k_pos_emb]`` in flight: the overlapped latent source.

    ``passed``: the tensors the caller handed to start_latent_gather, when they differ
    from the ones gathered (their autocast-dtype copies)."""

    def __init__(self, kv_latent: torch.Tensor, k_pos_emb: torch.Tensor, cp_group, passed=None):
        self.kv_latent, self.k_pos_emb, self.cp_group = kv_latent, k_pos_emb, cp_group
        self._passed = passed or (kv_latent, k_pos_emb)
        self._state = _State(cp_group)
        self.grad_mode = torch.is_grad_enabled()  # a gather started under no_grad has no backward
        latent = concat_latent(kv_latent, k_pos_emb)
        self._latent = _WaitForGradient.apply(latent, self._state)
        self._finish = inband.start(self._latent.detach(), cp_group, "latent")
        self._used = False

    def latent(self, setup) -> torch.Tensor:
        """Wait, then the gathered latent in position order, autograd-connected."""
        if self._used:
            raise ValueError("a LatentGather feeds one laga_attention call; start a new one per call")
        self._used = True
        gathered = _GatheredLatent.apply(self._latent, self._state, self._finish())
        return to_position_order(gathered, setup)

    def parts(self, setup):
        """The gathered latent as (kv part, rope key)."""
        return split_latent(self.latent(setup), setup)

    def lost_grads(self, kv_latent, k_pos_emb) -> bool:
        """Whether a call in the current grad mode would lose the latent's gradients: the
        gather ran outside autograd, but the call needs grads of what it gathered."""
        return (not self.grad_mode and torch.is_grad_enabled()
                and (kv_latent.requires_grad or k_pos_emb.requires_grad))

    def started_on(self, kv_latent, k_pos_emb) -> bool:
        """Whether this gather was started on these very tensors (as passed, or as gathered)."""
        return any(a is kv_latent and b is k_pos_emb
                   for a, b in (self._passed, (self.kv_latent, self.k_pos_emb)))


def start_latent_gather(kv_latent: torch.Tensor, k_pos_emb: torch.Tensor, *, cp_group,
                        check_ranks=None) -> LatentGather:
    """Launch the latent all-gather now; pass the result as ``latent_gather=`` to laga_attention.

    Needs a CP group of size > 1 (there is nothing to overlap without CP).
    ``check_ranks`` (None, True or False, as in laga_attention): first agree
    across the group on what the gather moves (shapes, dtype, which of the two
    need grads; a small blocking exchange, mindspeed_laga/agreement/), so a mismatch raises
    on every rank instead of corrupting the gather or hanging in backward.
    """
    if comm.check_group(cp_group) == 1:
        raise ValueError("start_latent_gather needs cp_group of size > 1; without context "
                         "parallelism call laga_attention without latent_gather")
    passed = (kv_latent, k_pos_emb)
    device = kv_latent.device.type if isinstance(kv_latent, torch.Tensor) else None
    dtype = autocast_dtype(device) if device else None
    if dtype is not None:  # gather what laga_attention will run on (api.py, autocast)
        kv_latent, k_pos_emb = to_autocast(passed, dtype)
    error = _local_error(kv_latent, k_pos_emb, check_ranks)
    values = agreement.gather_row(kv_latent, k_pos_emb, check_ranks, error is None)
    device = kv_latent.device if isinstance(kv_latent, torch.Tensor) else "cpu"
    with inband.joined(cp_group, "latent"):
        agreement.agree_call(cp_group, check_ranks, error, device, lambda: values)
    return LatentGather(kv_latent, k_pos_emb, cp_group, passed)


def _local_error(kv_latent, k_pos_emb, check_ranks):
    if check_ranks is not None and not isinstance(check_ranks, bool):
        return f"check_ranks must be True, False or None, got {check_ranks!r}"
    for name, t, nd in (("kv_latent", kv_latent, 3), ("k_pos_emb", k_pos_emb, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != nd:
            return f"{name} must be a 3-dim [s, b, d] tensor"
    if kv_latent.shape[:2] != k_pos_emb.shape[:2] or kv_latent.dtype != k_pos_emb.dtype:
        return "kv_latent and k_pos_emb must share [s, b] and dtype"
    if kv_latent.device.type == "meta" or k_pos_emb.device.type == "meta":
        return ("kv_latent and k_pos_emb on the meta device have no values: materialize the "
                "model (to_empty() and initialize, or load its checkpoint) first")
    if kv_latent.dtype not in agreement.DTYPES:
        return (f"kv_latent of dtype {kv_latent.dtype} is not supported: the forms run "
                f"{[str(d) for d in agreement.DTYPES]}; cast it (and k_pos_emb) to bfloat16")
    return None

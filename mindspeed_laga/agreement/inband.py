"""The in-band check of a later call: no extra collective, no read.

In micro-batch mode each later call's latent all-gather carries two int64 values per rank
after the latent (their bits, as the latent's dtype): the call's code (its row's hash, its
place in the micro-batch, a device hash of its weight and a linear's agreement_tensors)
and this rank's verdict (0, or WRONG: its latent is not the shape or dtype of the
micro-batch's first gather of that kind, or its call failed). After the gather every rank
compares them on the device; on any difference the gathered latent becomes NaN (so the
outputs are) and the ``latent`` flag is set, read at the next exchange or settle, which
names the field from the recorded rows when they differ. A rank that knows its call is
wrong sends a stand-in of the agreed shape (so no peer aborts on a size mismatch or waits
in the gather), then raises.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch

from .. import comm
from . import schedule, store

BAND = 2    # int64 values per rank after its latent
WRONG = 1   # the verdict of a rank whose latent is not the agreed shape or dtype
_BAND_BYTES = BAND * 8


def gather_seq(x: torch.Tensor, group, tag: str, kind: Optional[str] = None) -> torch.Tensor:
    """``comm.gather_seq`` of ``x`` [s, ...], checked in band in a later call (``kind``:
    which gathers share one agreed shape, default ``tag``)."""
    band = _band(x, group, kind or tag)
    if band is None:
        return comm.gather_seq(x, group, tag)
    return _Gather.apply(x, group, tag, band)


def start(x: torch.Tensor, group, tag: str, kind: Optional[str] = None):
    """An asynchronous raw gather of ``x``: (``finish()`` -> the gathered tensor, waited)."""
    band = _band(x, group, kind or tag)
    if band is None:
        out, pending = comm.all_gather_raw(x, group, "forward", tag, async_op=True)

        def plain():
            pending.wait()
            return out
        return plain
    out, pending = _launch(x, group, tag, band)
    return lambda: (pending.wait(), _unpack(out, x, group))[1]


@contextlib.contextmanager
def joined(group, kind: Optional[str]):
    """Around a call's agreement: a later call that fails on this rank still joins the
    gather of ``kind`` its peers make (a stand-in of the agreed shape, verdict WRONG), so
    they return NaN at once and name it at the next settle, instead of waiting in it."""
    try:
        yield
    except Exception:
        found = schedule._STATES.get(group) if group is not None and kind else None
        if found is not None and found.call_code is not None and kind in found.wires:
            shape, dtype, device = found.wires[kind]
            band = torch.full((BAND,), found.call_code, dtype=torch.int64, device=device)
            _send_stand_in(group, band, (shape, dtype, device))
        raise


def _band(x: torch.Tensor, group, kind: str) -> Optional[torch.Tensor]:
    """This call's band (None: gather plainly: no micro-batch, or its exchanging call,
    which records the shape its later calls must gather)."""
    found = schedule._STATES.get(group) if group is not None else None
    if found is None or not found.per_micro_batch:
        return None
    wire = (tuple(x.shape), x.dtype, x.device)
    if found.call_code is None:
        found.wires[kind] = wire
        return None
    band = torch.full((BAND,), found.call_code, dtype=torch.int64, device=x.device)
    if found.call_values is not None:  # the weight, FP8 scales: hashed on the device
        band[0].add_(found.call_values.to(x.device))
    agreed = found.wires.setdefault(kind, wire)
    if agreed != wire:
        _stand_in(x, group, band, agreed, wire)
    band[1].fill_(0)
    return band


def _send_stand_in(group, band, agreed: Tuple) -> None:
    """Zeros of the agreed shape with this rank's verdict WRONG: the peers' gather completes."""
    band[1].fill_(WRONG)
    stand_in = torch.zeros(agreed[0], dtype=agreed[1], device=agreed[2])
    out, pending = _launch(stand_in, group, "stand_in", band)
    pending.wait()
    _unpack(out, stand_in, group)


def _stand_in(x, group, band, agreed: Tuple, wire: Tuple) -> None:
    """Send a stand-in of the agreed shape, then raise naming what differs."""
    _send_stand_in(group, band, agreed)
    what = ("dtype" if agreed[0] == wire[0]
            else "shape [s, b, d] (local length, micro-batch, widths)")
    failure = ValueError(
        f"CP ranks disagree on the latent's {what} in a later call: this rank gathers "
        f"{list(wire[0])} {wire[1]}, the micro-batch's first call of this kind gathered "
        f"{list(agreed[0])} {agreed[1]} (this rank sent a stand-in of that shape; the peers' "
        "outputs are NaN and their next exchange or settle names it); pass the same local "
        "length, micro-batch, widths and dtype on every rank, and open a new micro-batch "
        "(new_micro_batch) before calls of another shape")
    schedule.state(group).failure = str(failure)
    raise store.tell_peers(failure, group, "fold")


def _launch(x: torch.Tensor, group, tag: str, band: torch.Tensor):
    packed = torch.cat([x.contiguous().reshape(-1), band.view(x.dtype)])  # its bits, as x's dtype
    return comm.all_gather_raw(packed, group, "forward", tag, async_op=True, side=_BAND_BYTES)


def _unpack(out: torch.Tensor, x: torch.Tensor, group) -> torch.Tensor:
    """The gathered latent (NaN if any rank's band differs), its flag noted unread."""
    size = comm.group_size(group)
    rows = out.view(size, -1)
    n = rows.shape[1] - _BAND_BYTES // x.element_size()
    data = rows[:, :n].contiguous().view((size * x.shape[0],) + tuple(x.shape[1:]))
    bands = rows[:, n:].contiguous().view(torch.int64)
    bad = (bands[:, 0] != bands[0, 0]).any() | (bands[:, 1] != 0).any()
    schedule.flag(group, "latent", bad)
    return data.masked_fill_(bad, float("nan"))


class _Gather(torch.autograd.Function):
    """The checked gather forward; its gradient reduce-scattered as comm.gather_seq's."""

    @staticmethod
    def forward(ctx, x, group, tag, band):
        ctx.group, ctx.tag = group, tag
        out, pending = _launch(x, group, tag, band)
        pending.wait()
        return _unpack(out, x, group)

    @staticmethod
    def backward(ctx, grad):
        return (comm._Collective.apply(grad, "reduce_scatter", ctx.group, ctx.tag, "cp",
                                       "backward"), None, None, None)

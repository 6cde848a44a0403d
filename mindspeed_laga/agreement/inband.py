"""The in-band check of a later call: no extra collective, no read.

A later call's latent all-gather carries two int64 per rank after the latent, as its
dtype: the call's code (its row, its place, a device hash of its weight and FP8 scales)
and the rank's verdict (0: it holds the expected shape). Compared on the device: any
difference makes the gathered latent NaN and sets the ``latent`` flag, named at the next
exchange or settle. The expected shape is the one at this place in the previous
micro-batch (while this one began alike), else the last of its kind in this one, else its
first. A rank that holds another sends a stand-in of that shape (no peer aborts on a size
mismatch) with the code of what it holds, and reads the verdicts, off the steady path:
every rank moved alike, then its real latent follows; else it raises naming the shapes.
"""
from __future__ import annotations

import contextlib
import functools
import zlib
from typing import Optional

import torch

from .. import comm
from . import schedule
from .content import _BITS

BAND = 2    # int64 values per rank after its latent
FAILED = 1  # the verdict of a rank whose call failed on its own


def gather_seq(x: torch.Tensor, group, tag: str, kind: Optional[str] = None) -> torch.Tensor:
    """``comm.gather_seq`` of ``x`` [s, ...], checked in band in a later call (``kind``: which
    gathers share a shape, default ``tag``)."""
    band = _band(x, group, kind or tag)
    if band is None:
        return comm.gather_seq(x, group, tag)
    if torch.is_grad_enabled() and not x.requires_grad and schedule.state(group).call_grads:
        x = x.detach().requires_grad_()  # joins the backward reduce-scatter its peers run
    return _Gather.apply(x, group, tag, band)


def start(x: torch.Tensor, group, tag: str, kind: Optional[str] = None):
    """An asynchronous raw gather of ``x``: (``finish()`` -> the gathered tensor, waited)."""
    band = _band(x, group, kind or tag)
    if band is None:
        out, pending = comm.all_gather_raw(x, group, "forward", tag, async_op=True)
        return lambda: (pending.wait(), out)[1]
    out, pending = _launch(x, group, tag, band)
    return lambda: (pending.wait(), _unpack(out, x, group, band))[1]


@contextlib.contextmanager
def joined(group, kind: Optional[str]):
    """Around a call's agreement: a later call that fails on this rank still joins the
    gather of ``kind`` its peers make (a stand-in, verdict FAILED), then raises."""
    try:
        yield
    except Exception:
        found = schedule._STATES.get(group) if group is not None and kind else None
        if found is not None and found.per_micro_batch and found.call_code is not None:
            expected = _expected(found, kind)
            if expected is not None:
                _send_stand_in(group, torch.tensor([found.call_code, FAILED],
                                                   device=expected[2]), expected)
        raise


def _expected(found, kind: str):
    """The (shape, dtype, device) a gather of ``kind`` is expected to hold, or None."""
    now, before = found.wires, found.pattern
    if now and len(now) < len(before) and before[0] == now[0]:
        return before[len(now)][1]
    same = [wire for k, wire in now if k == kind]  # else the first (exchanged) one's
    return same[-1] if same else now[0][1] if now else None


def _band(x: torch.Tensor, group, kind: str) -> Optional[torch.Tensor]:
    """This call's band (None: gather plainly: per-call mode or an exchanging call)."""
    found = schedule._STATES.get(group) if group is not None else None
    if found is None:
        return None
    wire, expected = (tuple(x.shape), x.dtype, x.device), _expected(found, kind)
    if len(found.wires) < schedule.ROWS_KEPT:
        found.wires.append((kind, wire))
    if not found.per_micro_batch or found.call_code is None:
        return None
    code = found.call_code if found.call_values is None else \
        found.call_values.to(x.device) + found.call_code  # the weight, FP8 scales: device hash
    band = _kept(x.device) * code  # [code, 0]: no copy from the host
    if expected is not None and expected != wire:
        _moved(group, band.clone(), expected, wire)
    return band


@functools.lru_cache(maxsize=8)  # the band's [1, 0] (int64), a poison's NaN (a float dtype)
def _kept(device, dtype=torch.int64) -> torch.Tensor:  # kept across calls: no op per call
    with torch.inference_mode(False):  # whatever mode made it
        return torch.tensor([1, 0] if dtype == torch.int64 else float("nan"), dtype=dtype,
                            device=device)


def _moved(group, band, expected, wire) -> None:
    """This rank holds another shape than expected: send a stand-in, read the verdicts;
    return if every rank moved to the same shape, else raise naming it."""
    mine = zlib.crc32(repr((wire[0], str(wire[1]))).encode()) + 2  # never 0 or FAILED
    band[1].fill_(mine)
    verdicts = _send_stand_in(group, band, expected)[:, 1].tolist()
    if all(v == mine for v in verdicts):
        schedule.state(group).pattern = []  # the rest of this micro-batch: by kind
        return
    what = "dtype" if expected[0] == wire[0] else \
        "shape [s, b, d] (local length, micro-batch, widths)"
    failure = ValueError(
        f"CP ranks disagree on the latent's {what} in a later call: this rank gathers "
        f"{list(wire[0])} {wire[1]}, the call at this place of the micro-batch gathered "
        f"{list(expected[0])} {expected[1]}; CP rank(s) {[r for r, v in enumerate(verdicts) if v]}"
        " hold another (each sent a stand-in of that shape; the peers' outputs are NaN and "
        "their next exchange or settle names it); run the same layers with the same local "
        "length, micro-batch, widths and dtype on every rank")
    schedule.state(group).failure = str(failure)
    raise comm.tell_peers(failure, group, "fold")


def _send_stand_in(group, band, expected) -> torch.Tensor:
    """Zeros of the expected shape beside ``band`` (the peers' gather completes): the bands."""
    stand_in = torch.zeros(expected[0], dtype=expected[1], device=expected[2])
    out, pending = _launch(stand_in, group, "stand_in", band)
    pending.wait()
    return _unpack(out, stand_in, group, None)


def _launch(x: torch.Tensor, group, tag: str, band: torch.Tensor):
    packed = torch.cat([x.contiguous().reshape(-1), band.view(x.dtype)])  # its bits, as x's dtype
    return comm.all_gather_raw(packed, group, "forward", tag, async_op=True, side=BAND * 8)


def _unpack(out: torch.Tensor, x: torch.Tensor, group, band):
    """The gathered latent, NaN if any rank's band differs from ``band`` (this rank's, verdict
    0), the flag noted unread; ``band`` None: every rank's band (a stand-in's sender)."""
    rows, bits = out.view(comm.group_size(group), -1), _BITS[x.element_size()]
    n = rows.shape[1] - BAND * 8 // x.element_size()
    if band is None:
        return rows[:, n:].contiguous().view(torch.int64)
    bad = (rows.view(bits)[:, n:] != band.view(bits)).any()  # as integers: NaN bits too
    schedule.flag(group, "latent", bad)
    return torch.where(bad, _kept(x.device, x.dtype), rows[:, :n]).view((-1,) + x.shape[1:])


class _Gather(torch.autograd.Function):
    """The checked gather forward; its gradient reduce-scattered as comm.gather_seq's."""

    @staticmethod
    def forward(ctx, x, group, tag, band):
        ctx.group, ctx.tag = group, tag
        out, pending = _launch(x, group, tag, band)
        pending.wait()
        return _unpack(out, x, group, band)

    @staticmethod
    def backward(ctx, grad):
        return (comm._Collective.apply(grad, "reduce_scatter", ctx.group, ctx.tag, "cp",
                                       "backward"), None, None, None)

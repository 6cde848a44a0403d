"""A non-finite key or value reaches only the query rows that attend it.

Masked keys must contribute nothing, but every kernel multiplies them by a
zero probability (``probs @ v``, or a flash kernel's block inside which some
keys are masked), and 0 x NaN is NaN: one NaN token's value would reach rows
that cannot see it (earlier rows under the causal mask, other documents).
Additive masks have the same hole on the key side (NaN + -inf is NaN).

So before any kernel runs, keys and values are made finite where they are not
(the whole key position zeroed: :func:`zero_bad_positions`), and afterwards
exactly the rows whose visible keys included such a position are set to NaN
(:func:`row_poison`), as exact attention gives: a visible NaN key or value
makes the row NaN, an invisible one changes nothing. Finding the positions
is one float32 (float64) sum over the last dim per tensor (no full-size
temporary, no host sync; a finite sum can only overflow for values beyond
1e36, which would overflow the scores anyway); zeroing writes only those
positions; with every value finite the poison is zero and the output is what
the kernel returned.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from .masks import Piece


def bad_positions(*xs: torch.Tensor) -> torch.Tensor:
    """x [..., d] (each of ``xs``: the same leading dims) -> [...] bool: True where the
    last dim of any of them holds a NaN or an inf."""
    return nan_positions(*xs).isnan()


def nan_positions(*xs: torch.Tensor) -> torch.Tensor:
    """:func:`bad_positions` as floats: NaN where bad, else zero (float32, or float64)."""
    sums = None
    for x in xs:
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        part = x.detach().sum(-1, dtype=acc)  # outside autograd: nothing saved
        sums = part if sums is None else sums.add_(part)
    return sums.mul_(0)  # 0 where every sum is finite, else NaN (one op for all of them)


def zero_bad_positions(x: torch.Tensor, bad: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``x`` with the positions ``bad`` (x's leading dims) zeroed: in place when the caller
    owns ``x`` (nothing else reads it), else a copy. Autograd does not see the zeroing:
    the kernel keeps the finite tensor, and the rows that saw the position are poisoned."""
    if not in_place:
        return x.masked_fill(bad.unsqueeze(-1), 0)
    # on the storage, past autograd (x may be a view of a custom Function's output,
    # which autograd forbids to change in place); nothing has saved x yet
    x.detach().masked_fill_(bad.unsqueeze(-1), 0)
    return x


def row_poison(bad: torch.Tensor, windows: Sequence[Window], causal: bool, dtype,
               nan_at: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[b, n_k, rows, 1] of 0 or NaN: NaN for a query row that sees a bad key, the rows of
    every window in order (what one cat of the windows' outputs adds).

    ``bad`` [b, n_k, K]: the bad positions of the key tensor; ``windows``: per query
    segment ``(rows, lo, hi, pieces)``, its rows see keys of ``bad[..., lo:hi]``,
    ``pieces`` as the kernels take them (None: one piece, all rows and keys, causal
    bottom-right aligned). One count over every window: no op per segment.
    ``nan_at``: ``bad`` as :func:`nan_positions` gives it; where every row sees keys from
    the first on (no documents), a row's poison is then the running sum of ``nan_at`` at
    its last key (NaN propagates, zeros add to zero): 3 ops, not 9."""
    windows = tuple(windows)
    if nan_at is not None:
        last = _last_keys_from_first(windows, causal, bad.device)
        if last is not None:
            poison = nan_at.cumsum(-1).index_select(-1, last)
            return (poison if poison.dtype == dtype else poison.to(dtype))[..., None]
    start, end = visible_keys(windows, causal, bad.device)
    counts = torch.nn.functional.pad(bad.to(torch.int32).cumsum(-1), (1, 0))
    seen = counts[..., end] - counts[..., start]
    nan, zero = _poison_values(dtype, bad.device)
    return torch.where(seen > 0, nan, zero)[..., None]


class Window(NamedTuple):
    """A query segment's rows and its key window ``[lo, hi)`` in the key tensor."""
    rows: int
    lo: int
    hi: int
    pieces: Optional[Tuple[Piece, ...]]


@lru_cache(maxsize=256)
def visible_keys(windows: Tuple[Window, ...], causal: bool,
                  device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per query row of every window, the keys it sees as key-tensor indices, [start, end)."""
    with torch.inference_mode(False):  # kept across calls, whatever mode made them
        start, end = _visible_on_host(windows, causal)
        return start.to(device), end.to(device)


@lru_cache(maxsize=256)
def _visible_on_host(windows: Tuple[Window, ...], causal: bool):
    with torch.inference_mode(False):
        starts, ends = [], []
        for rows, lo, hi, pieces in windows:
            start, end = _visible_ranges(rows, hi - lo, causal, pieces)
            starts.append(start + lo)
            ends.append(end + lo)
        return torch.cat(starts), torch.cat(ends)


@lru_cache(maxsize=256)
def _last_keys_from_first(windows: Tuple[Window, ...], causal: bool,
                          device: torch.device) -> Optional[torch.Tensor]:
    """Per query row, the last key it sees, when every row sees keys ``[0, last]``: every
    window starts at the first key and is one piece (no documents) that its first row
    sees (causal: at least as many keys as rows); else None. Decided on the windows alone:
    no read of any tensor, not even a host one, per call."""
    if not all(lo == 0 and pieces is None and hi >= (rows if causal else 1)
               for rows, lo, hi, pieces in windows):
        return None
    with torch.inference_mode(False):
        return (_visible_on_host(windows, causal)[1] - 1).to(device)


@lru_cache(maxsize=64)
def _poison_values(dtype, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode(False):
        return (torch.tensor(float("nan"), dtype=dtype, device=device),
                torch.zeros((), dtype=dtype, device=device))


def _visible_ranges(rows: int, keys: int, causal: bool,
                    pieces: Optional[Tuple[Piece, ...]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per query row, the window keys it sees, [start, end): pieces' rows see their key
    range, causal pieces bottom-right aligned (rows outside every piece see nothing)."""
    start = torch.zeros(rows, dtype=torch.long)
    end = torch.zeros(rows, dtype=torch.long)
    for q0, n, k0, k1 in pieces or ((0, rows, 0, keys),):
        start[q0:q0 + n] = k0
        end[q0:q0 + n] = k1 - torch.arange(n - 1, -1, -1) if causal else k1
    return start, end.clamp(min=start)

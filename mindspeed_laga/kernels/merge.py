"""The online-softmax merge: outputs of disjoint key ranges folded by their log-sum-exp.

Every kernel that attends keys in more than one call (the fused CPU/CUDA
segment in two calls, the blockwise walk's key blocks) merges with this
algebra, the one ring and flash attention use: with ``lse`` the running
log-sum-exp and ``l`` a new part's,
``new = logaddexp(lse, l)``, ``out = out * exp(lse - new) + o * exp(l - new)``.
"""
from __future__ import annotations

import torch


def _weights(lse, part_lse, may_be_empty: bool = False):
    new = torch.logaddexp(lse, part_lse)
    keep, add = torch.exp(lse - new), torch.exp(part_lse - new)
    if may_be_empty:  # rows that have seen no key yet (both -inf): keep zero, add nothing
        empty = torch.isinf(new)
        zero = torch.zeros((), dtype=keep.dtype, device=keep.device)
        keep, add = torch.where(empty, zero, keep), torch.where(empty, zero, add)
    return new, keep.unsqueeze(-1), add.unsqueeze(-1)


def merge_lse(parts):
    """(out, lse) of disjoint key ranges -> one (out, lse)."""
    out, lse = parts[0]
    for part_out, part_lse in parts[1:]:
        lse, keep, add = _weights(lse, part_lse)
        out = out * keep + part_out * add
    return out, lse


def merge_into(out, lse, rows, part_out, part_lse, may_be_empty: bool = False):
    """Fold one part's (out, lse) of ``rows`` into the running ``out``/``lse`` in place
    (no copy of the running output: the blockwise walk's accumulators). ``may_be_empty``:
    key padding, so a row may have seen no key in either (lse -inf in both)."""
    new, keep, add = _weights(lse[:, :, rows], part_lse, may_be_empty)
    out[:, :, rows].mul_(keep).add_(part_out * add)
    lse[:, :, rows] = new

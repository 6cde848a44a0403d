"""The weight every CP rank must hold alike (``kv_up_weight``): one exchange of a checksum of
its bits, which the adapters run on a module's first call, with their configuration."""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from .. import comm
from .fields import UNKNOWN
from .wire import exchange_device, raise_failure, raise_on_rejection


def check_same_weight(weight, cp_group, name: str = "kv_up_weight",
                      settings: Optional[Dict[str, Sequence[object]]] = None,
                      failure: Optional[BaseException] = None) -> None:
    """Raise on every rank unless every CP rank holds the same ``weight`` (bit for bit): CP
    ranks are replicas of one TP shard. One exchange of a checksum of its bits.
    ``settings``: {name: (this rank's value, its choices)}, an adapter's configuration, in
    the same exchange ("CP ranks disagree on <name>"). ``failure``: this rank could not
    produce the weight (None then): it re-raises it, its peers raise with its message."""
    if comm.group_size(cp_group) == 1:
        raise_failure(failure)
        return
    settings = settings or {}
    codes = [_setting_code(value, choices) for value, choices in settings.values()]
    device = exchange_device("meta" if failure is not None else weight.device, cp_group)
    checksum = 0 if failure is not None else weight_checksum(weight)
    table = comm.handshake([int(failure is not None), checksum] + codes, cp_group, device)
    raise_on_rejection(table, failure, cp_group, device)
    for i, (label, (_, choices)) in enumerate(settings.items(), start=2):
        values = [row[i] for row in table]
        if len(set(values)) > 1:
            shown = [choices[v] if choices and 0 <= v < len(choices) else v for v in values]
            raise ValueError(f"CP ranks disagree on {label}: {shown} (by rank); every CP rank "
                             "must be configured alike (no process group was built)")
    sums = [row[1] for row in table]
    if len(set(sums)) > 1:
        differ = [r for r, s in enumerate(sums) if s != sums[0]]
        raise ValueError(
            f"{name} differs between CP ranks: CP rank(s) {differ} hold other values than CP "
            f"rank 0 (checksums by rank {sums}); every rank of cp_group must hold the same "
            f"{name} (the CP ranks of one TP rank are replicas: load or initialize the weights "
            "with the same seed and keep them in sync through the data-parallel reduction)")


def _setting_code(value, choices) -> int:
    """A setting as an int64: its index among ``choices``, else the int itself."""
    if choices:
        return choices.index(value) if value in choices else UNKNOWN
    return int(value)


_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # odd int64: position-dependent weights, mod 2^64


def weight_checksum(weight) -> int:
    """An exact, order-independent checksum of a tensor's bits (int64 arithmetic wraps).

    The bits rather than the values: a float sum depends on the reduction order
    (thread counts), bits summed as integers do not. Each element is weighted
    by an odd function of its column and each row sum by one of its row, so
    swapped elements or rows change the sum."""
    flat = weight.detach()
    flat = flat.reshape(-1, flat.shape[-1]) if flat.dim() > 1 else flat.reshape(1, -1)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    bits = flat.view(width)
    device = bits.device
    cols = torch.arange(bits.shape[1], dtype=torch.int64, device=device) * 2 + 1
    total = torch.zeros((), dtype=torch.int64, device=device)
    step = max(1, _CHUNK // bits.shape[1])
    for start in range(0, bits.shape[0], step):  # int64 temporaries of one chunk at a time
        rows = (bits[start:start + step].to(torch.int64) * cols).sum(1)
        row_weight = torch.arange(start, start + rows.numel(), dtype=torch.int64, device=device)
        total += (rows * ((row_weight * 2 + 1) * _MIX)).sum()
    return int(total.item())


_CHUNK = 1 << 21

"""Content the ranks agree on, as codes: key padding, documents, weights, FP8 scales; and
the same-weight check. One device hash (``device_code``) serves all: an exchanging call
reads it once, a later call folds it unread. A tensor is recognised within a micro-batch by
its metadata (``tensor_key``), which holds it, so a freed address is not reused under it."""
from __future__ import annotations

import functools
import hashlib
import struct
from typing import Dict, Optional, Sequence

import torch

from .. import comm
from .fields import UNKNOWN
from .wire import exchange_device, raise_failure, raise_on_rejection

_GOLDEN, ODD = 0x9E3779B97F4A7C15 - (1 << 64), 0x632BE59BD9B4E019
PROBES_KEPT = 8     # position weights kept (by device, start, length), least recent dropped
CHUNK = 1 << 21     # values hashed at a time (int64 temporaries of one chunk)
SAMPLED = 4096      # values of a larger tensor a later call's code hashes (evenly spaced)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Held:
    """A tensor in a key, equal to any other: the key keeps it (and its address) alive."""
    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor

    def __eq__(self, other):
        return isinstance(other, _Held)

    def __hash__(self):
        return 0


def tensor_key(t: torch.Tensor) -> tuple:
    """A tensor's identity without a device read: storage, view and version counter (an
    in-place edit bumps the version; ``detach`` keeps all of them), holding the tensor."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            t.stride(), t.dtype, t._version, _Held(t))


def device_code(tensors, sample: bool = False) -> torch.Tensor:
    """A 0-d int64 device tensor hashing the bits of ``tensors`` (one or a list), each value
    times a pseudo-random odd int64 of its position, plus each one's length and width:
    int64 wraps, so it is exact in any reduction order; no read; two contents collide with
    probability about 2**-64. ``sample``: at most SAMPLED evenly spaced values of each."""
    code = None
    for t in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
        flat = t.detach().reshape(-1).view(_BITS[t.element_size()])
        if sample and flat.numel() > SAMPLED:
            flat = flat[::flat.numel() // SAMPLED][:SAMPLED]
        one = None
        for start in range(0, max(flat.numel(), 1), CHUNK):  # int64 products (promoted)
            part = flat if flat.numel() <= CHUNK else flat[start:start + CHUNK]
            part = (part * _probe(part.device, start, part.numel())).sum()
            one = part if one is None else one + part
        one = one + (flat.numel() * 16 + t.element_size())
        code = one if code is None else code * ODD + one
    return code


@functools.lru_cache(maxsize=PROBES_KEPT)
def _probe(device, start: int, n: int) -> torch.Tensor:
    mixed = torch.arange(start + 1, start + n + 1, dtype=torch.int64, device=device) * _GOLDEN
    return ((mixed ^ (mixed >> 29)) * ODD) | 1


def padding_counts(mask) -> list:
    """Padding keys per sample (what the message shows when ranks disagree)."""
    return [int(x) for x in mask.sum(dim=1).tolist()]


def padding_code(mask) -> int:
    """``mask`` ([b, S] bool or None) as one int64, read: 0 for None."""
    return 0 if mask is None else int(device_code(mask).item()) or 1


def documents_code(documents) -> int:
    """Host values (document boundaries, what a function is) as one int64 (0: None)."""
    if documents is None:
        return 0
    digest = hashlib.blake2b(repr(documents).encode(), digest_size=8).digest()
    return struct.unpack("<q", digest)[0] or 1


def weight_checksum(weight) -> int:
    """An exact checksum of a tensor's bits (not its values: the same in any reduction order)."""
    return int(device_code(weight).item())


def check_same_weight(weight, cp_group, name: str = "kv_up_weight",
                      settings: Optional[Dict[str, Sequence[object]]] = None,
                      failure: Optional[BaseException] = None) -> None:
    """Raise on every rank unless every CP rank (a replica of one TP shard) holds the same
    ``weight``, bit for bit; ``settings``: {name: (value, choices)}, an adapter's configuration
    agreed in the same exchange; ``failure``: this rank has no weight, its peers are told."""
    if comm.group_size(cp_group) == 1:
        raise_failure(failure)
        return
    settings = settings or {}
    codes = [(choices.index(value) if value in choices else UNKNOWN) if choices else int(value)
             for value, choices in settings.values()]
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

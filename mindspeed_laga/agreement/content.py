"""Content the ranks agree on: key padding and document boundaries, as codes.

Host codes (``padding_code``, ``documents_code``) read the values: the exchanging call of a
micro-batch does, once. Later calls never read the device: a mask is hashed there
(``device_code``) and folded, in call order, into a device-side digest that travels in the
next exchange or settle. A tensor is recognised within a micro-batch by its metadata
(``tensor_key``), and the key holds the tensor for as long as the micro-batch's memo keeps
it, so a freed address cannot be reused under it.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

import torch

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
ODD = 0x632BE59BD9B4E019
_WEIGHTS: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
WEIGHTS_KEPT = 8  # weight vectors kept (by device and length), least recently used dropped


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


def device_code(t: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 device tensor hashing ``t``'s values with a pseudo-random 64-bit weight per
    position (int64 arithmetic wraps): no host read; two tensors collide with probability
    about 2**-64."""
    flat = t.detach().reshape(-1).to(torch.int64)
    key = (flat.device, flat.numel())
    weights = _WEIGHTS.pop(key, None)
    if weights is None:
        pos = torch.arange(1, flat.numel() + 1, dtype=torch.int64, device=flat.device)
        mixed = pos * _GOLDEN
        mixed = mixed ^ (mixed >> 29)
        weights = (mixed * ODD) | 1
    _WEIGHTS[key] = weights
    while len(_WEIGHTS) > WEIGHTS_KEPT:
        _WEIGHTS.popitem(last=False)
    return (flat * weights).sum() + flat.numel()


def padding_counts(mask) -> list:
    """Padding keys per sample (what the message shows when ranks disagree)."""
    return [int(x) for x in mask.sum(dim=1).tolist()]


def padding_code(mask) -> int:
    """``mask`` ([b, S] bool or None) as one int64: 0 for None, else a blake2b digest of its
    shape and bits (a hash: a linear checksum lets other padded keys look alike)."""
    if mask is None:
        return 0
    flat = mask.detach().reshape(-1).to(torch.uint8)
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 8)]).view(-1, 8)
    packed = (flat << torch.arange(8, device=flat.device, dtype=torch.uint8)).sum(1)
    digest = hashlib.blake2b(repr(list(mask.shape)).encode(), digest_size=8)
    digest.update(bytes(packed.to(torch.uint8).tolist()))  # eight keys a byte, then hashed
    return struct.unpack("<q", digest.digest())[0] or 1


def documents_code(documents) -> int:
    """The document boundaries as one int64 (0: no documents)."""
    if documents is None:
        return 0
    digest = hashlib.blake2b(repr(documents).encode(), digest_size=8).digest()
    return struct.unpack("<q", digest)[0] or 1


SAMPLED = 4096  # values of a larger tensor hashed (evenly spaced) by values_code
_PROBES: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()


def values_code(tensors) -> torch.Tensor:
    """A 0-d int64 device tensor, the bits of a dot product of ``tensors``' values (a
    weight, FP8 scales; at most SAMPLED evenly spaced values of each) with fixed
    pseudo-random weights: equal values give equal codes on every rank, a value off by
    any amount changes it (but for a chance cancellation). A few launches, no read."""
    code = None
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.numel() > SAMPLED:
            flat = flat[::flat.numel() // SAMPLED][:SAMPLED]
        one = torch.dot(flat.to(torch.float64), _probe(flat.device, flat.numel()))
        code = one if code is None else code * 1.000003 + one
    return code.view(torch.int64) if code is not None else None


def _probe(device, n: int) -> torch.Tensor:
    key = (device, n)
    probe = _PROBES.pop(key, None)
    if probe is None:
        g = torch.Generator().manual_seed(n)
        probe = (torch.rand(n, generator=g, dtype=torch.float64) + 0.5).to(device)
    _PROBES[key] = probe
    while len(_PROBES) > WEIGHTS_KEPT:
        _PROBES.popitem(last=False)
    return probe

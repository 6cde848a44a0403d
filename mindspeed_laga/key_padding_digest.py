"""Key padding as the ranks' agreement sees it: a digest of the mask, and what the message
shows when ranks differ (padding keys per sample). Each reads the mask on the host: the
agreement reads it once per micro-batch at most (agreement.content_code)."""
from __future__ import annotations

import hashlib
import struct

import torch


def padding_counts(mask) -> list:
    """Padding keys per sample (what the handshake shows when ranks disagree)."""
    return [int(x) for x in mask.sum(dim=1).tolist()]


def padding_code(mask) -> int:
    """``mask`` ([b, S] bool or None) as one int64 for the handshake: 0 for None, else a
    blake2b digest of its shape and its bits. A hash, not a weighted sum: a linear
    checksum lets masks with other padded keys (even other pad counts) look alike."""
    if mask is None:
        return 0
    flat = mask.detach().reshape(-1).to(torch.uint8)
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 8)]).view(-1, 8)
    packed = (flat << torch.arange(8, device=flat.device, dtype=torch.uint8)).sum(1)
    digest = hashlib.blake2b(repr(list(mask.shape)).encode(), digest_size=8)
    digest.update(bytes(packed.to(torch.uint8).tolist()))  # eight keys a byte, then hashed
    return struct.unpack("<q", digest.digest())[0] or 1

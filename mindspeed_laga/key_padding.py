"""Key padding (``key_padding_mask``): checking the mask, and what a row with no key returns
(what the ranks agree on about it: agreement/content.py).

The contract (docs/DESIGN.md, section "Key padding"): a bool tensor [b, S]
(S = local length x CP, the full sequence) in global position order, True =
a padding key, the same on every CP rank. It masks keys only: every query
row still follows ``causal`` (or sees every key), minus the padding keys.
What a row that then sees no key returns: ``vocab.names.EMPTY_ROWS``.
"""
from __future__ import annotations

import torch

from .vocab.names import EMPTY_ROWS


def check_key_padding(mask, query, cp_size: int, documents) -> None:
    """ValueError naming the fix unless ``mask`` is None or a [b, S] bool tensor on query's device."""
    if mask is None:
        return
    b, seq_len = query.shape[1], query.shape[0] * cp_size
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError("key_padding_mask must be a bool tensor [micro-batch, sequence length] "
                         f"(True = padding key), got {_describe(mask)}")
    if tuple(mask.shape) != (b, seq_len):
        raise ValueError(
            f"key_padding_mask must be [micro-batch, full sequence length] = [{b}, {seq_len}] "
            f"(local length {query.shape[0]} x CP {cp_size}, global position order), got "
            f"{list(mask.shape)}")
    if mask.device != query.device:
        raise ValueError(f"key_padding_mask is on {mask.device}, the inputs on {query.device}; "
                         "move it to the inputs' device")
    if documents is not None:
        raise ValueError("key_padding_mask with cu_seqlens (packed documents) is not supported: "
                         "a packed sequence has no padding keys to mask; pass one or the other")


def check_empty_rows(value) -> None:
    if value not in EMPTY_ROWS:
        raise ValueError(f"empty_rows must be one of {EMPTY_ROWS}, got {value!r}")


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {list(x.shape)}"
    return type(x).__name__


def empty_rows(key_padding, segments, causal: bool):
    """[b, 1, s_q, 1] bool: the query rows (of ``segments``, in order) that see no key:
    under the causal mask every key up to their position is padding, else every key."""
    valid = (~key_padding).cumsum(dim=1)  # [b, S]: non-padding keys up to each position
    if not causal:
        seen = valid[:, -1:].expand(-1, sum(n for _, n, _ in segments))
    else:
        positions = torch.cat([torch.arange(g, g + n) for _, n, g in segments])
        seen = valid[:, positions.to(valid.device)]
    return (seen == 0)[:, None, :, None]

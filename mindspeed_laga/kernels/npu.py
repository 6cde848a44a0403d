"""Ascend ``torch_npu.npu_fusion_attention``.

The recipe of DESIGN.md section 3: keys are sliced to the segment's causal
prefix and the call uses ``sparse_mode=3`` (right-down causal) with the
compressed 2048x2048 ``triu(diagonal=1)`` bool mask (True = masked). Layout
BNSD, so q/k head dim 192 and v head dim 128 go in unpadded
(``--mla-fa-without-pad``); ``n_k`` may divide ``n`` (grouped heads).
"""
from __future__ import annotations

import importlib

import torch

_MASK_CACHE = {}


def require_torch_npu():
    """Import torch_npu or raise the error that names the fix."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        raise ValueError(
            "kernel='npu' needs torch_npu (Ascend CANN + torch_npu matching your torch; "
            "pip install mindspeed-laga[npu]); on CPU/GPU use kernel='sdpa' or 'eager'"
        ) from exc


def compressed_causal_mask(device) -> torch.Tensor:
    """The 2048x2048 mask sparse_mode 2/3/4 expect: True above the diagonal."""
    key = str(device)
    if key not in _MASK_CACHE:
        _MASK_CACHE[key] = torch.ones(2048, 2048, dtype=torch.bool, device=device).triu(diagonal=1)
    return _MASK_CACHE[key]


def attend_segment(q, k, v, *, scale: float, causal: bool):
    torch_npu = require_torch_npu()
    kwargs = dict(input_layout="BNSD", scale=scale, keep_prob=1.0)
    if causal:
        kwargs.update(atten_mask=compressed_causal_mask(q.device), sparse_mode=3)
    return torch_npu.npu_fusion_attention(q, k, v, q.shape[1], **kwargs)[0]

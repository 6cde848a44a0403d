"""The dtype kernels accumulate in: float32 for half precision, else the input's own."""
from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate half precision in float32; float32 and float64 stay as they are."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# ---------------------------------------------------------------- torch.autocast

# What autocast casts (float64 it leaves alone, as its own matmul rule does).
AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


def autocast_dtype(device_type: str):
    """The dtype of an enabled ``torch.autocast`` region for ``device_type``, else None."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return None
    return torch.get_autocast_dtype(device_type) if enabled else None


def to_autocast(tensors, dtype):
    """Cast the autocast-eligible floating tensors to ``dtype`` (differentiably; the grads of
    float32 inputs come back float32); anything else passes unchanged."""
    return [t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in AUTOCAST_ELIGIBLE else t
            for t in tensors]

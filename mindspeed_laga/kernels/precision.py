"""The dtype kernels accumulate in: float32 for half precision, else the input's own."""
from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate half precision in float32; float32 and float64 stay as they are."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

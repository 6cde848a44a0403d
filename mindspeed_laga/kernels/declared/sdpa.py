"""The SDPA kernel's declaration (its calls: ``kernels/sdpa.py``)."""
from __future__ import annotations

from ..base import Kernel, running


class Sdpa(Kernel):
    """PyTorch's fused attention (dense) and its fused ops per key block (blockwise);
    ``auto``'s pick off NPU where the blockwise path has fused block ops."""

    name = "sdpa"
    block_note = "fused block ops"
    in_training_flag = False  # the Ascend training flag offers the kernels tested there
    aliases = ("fused",)

    @classmethod
    def model_kind(cls, device_type):
        # torch SDPA is the cost model's "sdpa" on CPU only: its accelerator kernels keep no
        # score matrix ("fused")
        return "sdpa" if device_type == "cpu" else "fused"

    @classmethod
    def picks_auto(cls, device, dtype, blockwise):
        return not blockwise or _fused_block_ops(device, dtype)

    @classmethod
    def check(cls, device, dtype, blockwise):
        if blockwise and not _fused_block_ops(device, dtype):
            raise ValueError(
                f"recompute_kv=True with kernel='sdpa' runs fused block ops for CPU tensors and "
                f"CUDA tensors other than float64, not {device.type} {dtype}; use kernel='eager' "
                "(or 'auto', which picks it)")

    def attend_segment(self, q, k, v, *, scale, causal, pieces=None, keep=None):
        return running("sdpa").attend_segment(q, k, v, scale=scale, causal=causal,
                                              pieces=pieces, keep=keep)

    def attend_rows(self, q, k, v, *, scale, windows):
        return running("sdpa").attend_rows(q, k, v, scale=scale, windows=windows)

    @property
    def block(self):
        from ..sdpa import FusedBlock
        return FusedBlock


def _fused_block_ops(device, dtype) -> bool:
    from ..sdpa import fused_block_ops  # asked with tensors at hand: torch is loaded
    return fused_block_ops(device, dtype)

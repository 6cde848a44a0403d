"""The NPU kernel's declaration (its calls: ``kernels/npu.py``)."""
from __future__ import annotations

from ..base import Kernel, running


class Npu(Kernel):
    """Ascend ``npu_fusion_attention`` (dense and per key block); ``auto``'s pick on NPU
    tensors. ``pad_v``: V zero-padded to the q/k head dim for the op (kernels/npu.py)."""

    name = "npu"
    pads_v = True
    documents_need_build = True
    device = "npu"
    device_host = "an Ascend host"

    @classmethod
    def picks_auto(cls, device, dtype, blockwise):
        return device.type == "npu"

    @classmethod
    def check(cls, device, dtype, blockwise):
        cls.check_installed()

    @classmethod
    def check_installed(cls):
        from ..npu import require_torch_npu
        require_torch_npu()

    @classmethod
    def model_kind(cls, device_type):
        return "npu"

    def attend_segment(self, q, k, v, *, scale, causal, pieces=None, keep=None):
        return running("npu").attend_segment(q, k, v, scale=scale, causal=causal,
                                             pad_v=self.pad_v, pieces=pieces, keep=keep)

    @property
    def block(self):
        from ..npu import NpuBlock, NpuBlockPadV
        return NpuBlockPadV if self.pad_v else NpuBlock

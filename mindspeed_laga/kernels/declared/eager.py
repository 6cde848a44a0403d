"""The eager kernel's declaration (its math: ``kernels/eager.py``)."""
from __future__ import annotations

from ..base import Kernel, running


class Eager(Kernel):
    """Plain torch math: scores materialized (kept for backward by the dense kernel, one
    block at a time by the block kernel); ``auto``'s pick where nothing fused runs."""

    name = "eager"
    block_note = "no fused block op, eager math"

    @classmethod
    def picks_auto(cls, device, dtype, blockwise):
        return True

    @classmethod
    def model_kind(cls, device_type):
        return "eager"  # the score matrix is materialized and kept

    def attend_segment(self, q, k, v, *, scale, causal, pieces=None, keep=None):
        return running("eager").attend_segment(q, k, v, scale=scale, causal=causal,
                                               pieces=pieces, keep=keep)

    @property
    def block(self):
        from ..eager import EagerBlock
        return EagerBlock

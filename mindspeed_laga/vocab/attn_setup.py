"""What a form needs besides the tensors: :class:`AttnSetup`, made once per call by the checks."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, List, Tuple

from ..cp_algos import SplitView, algo
from .dims import MLADims
from .keys import key_ranges
from .segments import Documents, Segment, query_segments

if TYPE_CHECKING:  # the kernels import torch; this vocabulary does not
    from ..kernels.base import Kernel


def heads_split(cp_algo: str, cp_size: int, ulysses_degree: int = 1) -> bool:
    """Whether heads are split (ulysses: over the CP group; hybrid: over its Ulysses
    group of ``ulysses_degree`` ranks) rather than all kept."""
    return algo(cp_algo).heads_split(cp_size, ulysses_degree)


@dataclass(frozen=True)
class AttnSetup(SplitView):  # algo, heads_split, split_size: asked of the CP algorithm
    """Everything a form needs besides the tensors (made by ``checks.check``)."""

    dims: MLADims
    local_len: int
    batch: int
    cp_group: object
    cp_size: int
    cp_rank: int
    cp_algo: str
    layout: str
    causal: bool
    kernel: "Kernel"              # resolved once (kernels/registry.py), its options (pad_v) bound
    softmax_scale: float
    documents: Documents = None   # cu_seqlens (global), or None: one sequence
    # Hybrid CP only: the Ulysses group (U consecutive CP ranks holding this one) and U.
    # U also names the hybrid layout (docs/DESIGN.md "Hybrid CP"); 1 everywhere else.
    ulysses_group: object = None
    ulysses_degree: int = 1
    # key_padding_mask [b, S] bool (True = padding key, position order) or None, and what a
    # row that sees no key returns (``names.EMPTY_ROWS``; mindspeed_laga/key_padding.py)
    key_padding: object = None
    empty_rows: str = "mean"

    # Asked several times per call: kept on the instance (frozen, so never stale).
    @cached_property
    def algo(self):
        return SplitView.algo.fget(self)

    @cached_property
    def heads_split(self) -> bool:
        return SplitView.heads_split.fget(self)

    @property
    def split_group(self):
        """The group the head all-to-alls run over: the Ulysses group (hybrid) or cp_group."""
        return self.algo.split_group(self.cp_group, self.ulysses_group)

    @property
    def split_rank(self) -> int:
        return self.algo.split_rank(self.cp_rank, self.ulysses_degree)

    @property
    def seq_len(self) -> int:
        """The full sequence length (every rank's tokens)."""
        return self.local_len * self.cp_size

    def head_slice(self) -> Tuple[int, int]:
        """(first, count): the heads this rank attends (all, or its n/P block)."""
        n = self.dims.heads
        if not self.heads_split:
            return 0, n
        h = n // self.split_size
        return self.split_rank * h, h

    def query_segments(self) -> List[Segment]:
        """Segments of the queries the attention sees on this rank."""
        return query_segments(self.layout, self.cp_size, self.cp_rank, self.local_len,
                              self.heads_split, self.documents,
                              ulysses_degree=self.ulysses_degree)

    def key_ranges(self) -> List[Tuple[int, int]]:
        """Position ranges of the keys this rank's queries see (what trimming rebuilds)."""
        return key_ranges(self.query_segments(), self.seq_len, self.causal, self.documents)

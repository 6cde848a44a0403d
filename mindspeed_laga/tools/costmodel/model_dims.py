"""A sparse (DSA) model's own sizes beside its MLA dims: the lightning indexer's and which
layers share picks."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IndexerDims:
    """The lightning indexer's sizes: ``--index-n-heads`` and ``--index-head-dim``."""
    heads: int = 64
    head_dim: int = 128


@dataclass(frozen=True)
class IndexShare:
    """Which layers run the indexer (MindSpeed-LLM's ``--index-topk-freq`` and
    ``--index-skip-topk-offset``): global layer L takes the picks of
    ``L - (max(L - offset, 0) % freq)``; the others reuse them."""
    freq: int = 1
    offset: int = 2
    num_layers: int = 1

    def computes(self, layer: int) -> bool:
        return max(layer - self.offset, 0) % self.freq == 0

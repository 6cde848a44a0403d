"""What one multi-rank run is: an MLA shape, a case (a variant and where it runs),
the seeded full-sequence inputs every rank builds, and each rank's shard of them.

Shared by the runner (``measure``) and the checks (``equivalence``), which
import it and not each other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .. import layout as layouts
from .mla_shape import MLAShape
from .runspec import RunSpec

INPUTS = ("query", "kv_latent", "k_pos_emb", "kv_up_weight")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


@dataclass(frozen=True)
class Case:
    """A variant (``spec``) run on CP ranks with a cp_algo, layout, kernel and dtype.

    Give either ``spec`` or ``form`` + ``options`` (``((keyword, value), ...)``,
    an ``("overlap", True)`` item included); the other pair is derived.
    """

    form: str = "laga"
    cp_algo: str = "allgather"
    layout: str = "zigzag"
    kernel: str = "eager"
    dtype: str = "float32"
    causal: bool = True
    shape: MLAShape = MLAShape()
    seed: int = 1234
    options: tuple = ()
    spec: Optional[RunSpec] = None
    cu_seqlens: Optional[Tuple[int, ...]] = None   # packed documents' global boundaries (batch 1)
    ulysses_degree: int = 1                        # cp_algo="hybrid": U (its layout too)

    def __post_init__(self):
        if self.spec is None:
            object.__setattr__(self, "spec", RunSpec.from_options(self.form, self.form, self.options))
        else:
            object.__setattr__(self, "form", self.spec.form)
            object.__setattr__(self, "options", self.spec.option_items())

    def label(self) -> str:
        opts = "".join(f",{k}={v}" for k, v in self.options)
        docs = f",documents={len(self.cu_seqlens) - 1}" if self.cu_seqlens else ""
        return f"{self.form}/{self.cp_algo}/{self.layout}/{self.kernel}/{self.dtype}{opts}{docs}"


def full_inputs(shape: MLAShape, seed: int) -> Dict[str, torch.Tensor]:
    """Float64 full-sequence inputs and an output gradient, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    S, b, n = shape.seq_len, shape.batch, shape.heads
    d_n, d_r, d_v, d_c = shape.qk_head_dim, shape.rope_dim, shape.v_head_dim, shape.kv_lora_rank

    def randn(*size, scale=1.0):
        return torch.randn(*size, generator=g, dtype=torch.float64) * scale

    return {
        "query": randn(S, b, n, d_n + d_r),
        "kv_latent": randn(S, b, d_c),
        "k_pos_emb": randn(S, b, d_r),
        "kv_up_weight": randn(n * (d_n + d_v), d_c, scale=d_c ** -0.5),
        "grad_out": randn(S, b, n * d_v),
    }


def shard(t: torch.Tensor, case: Case, rank: int, cp_size: int) -> torch.Tensor:
    """This rank's part of a full input; ``kv_up_weight`` is replicated over CP."""
    if t.dim() == 2:
        return t.clone()
    return layouts.shard(t, case.layout, cp_size, rank, cu_seqlens=case.cu_seqlens,
                         ulysses_degree=case.ulysses_degree)

"""Multi-rank runs of the forms checked against the single-device reference.

One *case* = form x cp_algo x layout x kernel x dtype (+ form options) at one
MLA shape. Every rank builds the same full-sequence inputs from a seed, takes
its shard, runs the form forward and backward, and returns its output shard,
its input-grad shards and its partial ``kv_up_weight`` grad. The caller
unshards them (the weight grads are summed, as Megatron's dp x cp reduction
does) and compares with :func:`mindspeed_laga.reference.mla_attention_reference`
run in float64 on the full sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import torch

from . import layout as layouts
from .reference import mla_attention_reference

INPUTS = ("query", "kv_latent", "k_pos_emb", "kv_up_weight")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


@dataclass(frozen=True)
class MLAShape:
    """Full-sequence MLA sizes. The default is DeepSeek-shaped but tiny."""

    seq_len: int = 64
    batch: int = 2
    heads: int = 8
    qk_head_dim: int = 16
    rope_dim: int = 8
    v_head_dim: int = 16
    kv_lora_rank: int = 32

    @property
    def softmax_scale(self) -> float:
        return (self.qk_head_dim + self.rope_dim) ** -0.5


@dataclass(frozen=True)
class Case:
    form: str = "laga"
    cp_algo: str = "allgather"
    layout: str = "zigzag"
    kernel: str = "eager"
    dtype: str = "float32"
    causal: bool = True
    shape: MLAShape = MLAShape()
    seed: int = 1234
    options: tuple = ()  # form keywords as ((name, value), ...); ("overlap", True) starts
                         # the latent gather before the call (CP > 1)

    def label(self) -> str:
        opts = "".join(f",{k}={v}" for k, v in self.options)
        return f"{self.form}/{self.cp_algo}/{self.layout}/{self.kernel}/{self.dtype}{opts}"


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
    return layouts.shard(t, case.layout, cp_size, rank)


def worker(rank: int, cp_size: int, cases: List[Case], repeat: int = 1, warmup: int = 0) -> List[dict]:
    """Entry point for :func:`mindspeed_laga.spawn.run_on_ranks`: forward + backward of
    each case on this rank (``measure.run_on_rank``); shards and partial grads back."""
    from .measure import Run, worker as run_worker
    return run_worker(rank, cp_size, [Run(c, c.label()) for c in cases], repeat, warmup)


def assemble(per_rank: List[dict], case: Case) -> dict:
    """Rank shards -> full output and grads (weight grads summed over ranks)."""
    grads = {}
    for name in INPUTS:
        parts = [r["grads"][name].double() for r in per_rank]
        grads[name] = sum(parts) if name == "kv_up_weight" else layouts.unshard(parts, case.layout)
    return {"out": layouts.unshard([r["out"].double() for r in per_rank], case.layout),
            "grads": grads}


def reference(case: Case) -> dict:
    """Float64 single-device output and grads on the full sequence, from the same
    (dtype-rounded) inputs the ranks used."""
    full = full_inputs(case.shape, case.seed)
    dtype = DTYPES[case.dtype]
    inputs = {k: full[k].to(dtype).double().requires_grad_() for k in INPUTS}
    out = mla_attention_reference(*(inputs[k] for k in INPUTS),
                                  softmax_scale=case.shape.softmax_scale, causal=case.causal)
    out.backward(full["grad_out"].to(dtype).double())
    return {"out": out.detach(), "grads": {k: v.grad for k, v in inputs.items()}}


def relative_errors(got: dict, ref: dict) -> Dict[str, float]:
    """max |got - ref| / max |ref| for the output and each input grad."""
    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    errs = {"out": rel(got["out"], ref["out"])}
    errs.update({f"d_{k}": rel(got["grads"][k], ref["grads"][k]) for k in INPUTS})
    return errs

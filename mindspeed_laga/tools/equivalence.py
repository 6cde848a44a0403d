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

from typing import Dict, List

from .. import layout as layouts
from .cases import DTYPES, INPUTS, Case, MLAShape, full_inputs, shard
from ..reference import mla_attention_reference

# Cases and their inputs live in ``cases`` (shared with ``measure``); re-exported here.
__all__ = ["DTYPES", "INPUTS", "Case", "MLAShape", "full_inputs", "shard", "assemble",
           "reference", "relative_errors"]



def assemble(per_rank: List[dict], case: Case) -> dict:
    """Rank shards -> full output and grads (weight grads summed over ranks)."""
    def full(parts):
        return layouts.unshard([p.double() for p in parts], case.layout, cu_seqlens=case.cu_seqlens,
                               ulysses_degree=case.ulysses_degree)

    grads = {name: (sum(r["grads"][name].double() for r in per_rank) if name == "kv_up_weight"
                    else full([r["grads"][name] for r in per_rank])) for name in INPUTS}
    return {"out": full([r["out"] for r in per_rank]), "grads": grads}


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

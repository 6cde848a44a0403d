"""Packed documents for the tests: small MLA inputs, document sets per CP size, and a
float64 single-process attention with a document mask built from each position's
document id (it knows nothing of segments, windows or pieces)."""
from __future__ import annotations

import torch

from mindspeed_laga import absorbed_attention, explicit_attention, laga_attention
from mindspeed_laga import layout as layouts
from mindspeed_laga.tools.cases import MLAShape, full_inputs as shape_inputs

from .variants import PLAIN_ALGOS

S, HEADS, D_N, D_R, D_V, D_C = 32, 4, 8, 4, 8, 16


SCALE = (D_N + D_R) ** -0.5
SHAPE = MLAShape(seq_len=S, batch=1, heads=HEADS, qk_head_dim=D_N, rope_dim=D_R, v_head_dim=D_V,
                 kv_lora_rank=D_C)



FORMS = {"explicit": explicit_attention, "absorbed": absorbed_attention, "laga": laga_attention}



def document_sets(cp):
    """One document, equal ones, ragged ones crossing rank boundaries, many short ones
    (length 2P); doc_zigzag gets lengths divisible by 2P."""
    step = 2 * cp
    return {
        "one": [0, S],
        "equal": [0, 8, 16, 24, 32],
        "ragged": [0, 5, 19, 32],
        "ragged_2p": [0, step, 3 * step, S] if 3 * step < S else [0, step, S],
        "short": list(range(0, S + 1, step)),
    }


def algos_and_layouts(cp):
    """The CP algorithms and layouts a documents case runs with. At CP 1 there is no group
    and every layout is the identity: each makes the same call (bitwise), so one of each."""
    if cp == 1:
        return PLAIN_ALGOS[:1], ("contiguous",)
    return PLAIN_ALGOS, ("contiguous", "zigzag", "doc_zigzag")


def doc_zigzag_ok(bounds, cp):
    return all((b - a) % (2 * cp) == 0 for a, b in zip(bounds[:-1], bounds[1:]))



def full_inputs(seed=0):
    """Float64 full-sequence inputs and ``grad_out`` (the shared shape helper's draw)."""
    return shape_inputs(SHAPE, seed)



def reference(bounds, causal):
    """Float64 attention of the full sequence with a document mask built from ids."""
    x = full_inputs()
    inputs = {k: x[k].clone().requires_grad_() for k in ("query", "kv_latent", "k_pos_emb", "kv_up_weight")}
    q, kv, kpe, w = (inputs[k] for k in ("query", "kv_latent", "k_pos_emb", "kv_up_weight"))
    w3 = w.view(HEADS, D_N + D_V, D_C)
    k_nope = torch.einsum("sbc,ndc->sbnd", kv, w3[:, :D_N])
    value = torch.einsum("sbc,nvc->sbnv", kv, w3[:, D_N:])
    key = torch.cat([k_nope, kpe[:, :, None].expand(S, 1, HEADS, D_R)], dim=-1)
    doc = torch.zeros(S, dtype=torch.long)
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        doc[a:b] = i
    pos = torch.arange(S)
    keep = doc[:, None] == doc[None, :]
    if causal:
        keep &= pos[None, :] <= pos[:, None]
    scores = torch.einsum("qbnd,kbnd->bnqk", q, key) * SCALE
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    out = torch.einsum("bnqk,kbnv->qbnv", probs, value).reshape(S, 1, HEADS * D_V)
    out.backward(x["grad_out"])
    return out.detach(), {k: v.grad for k, v in inputs.items()}



def assemble(per_rank, case, cp):
    if cp == 1:
        return per_rank[0]["out"], per_rank[0]["grads"]
    bounds = case["bounds"]

    def full(parts):
        return layouts.unshard(parts, case["layout"], cu_seqlens=bounds)

    grads = {k: full([r["grads"][k] for r in per_rank]) for k in ("query", "kv_latent", "k_pos_emb")}
    grads["kv_up_weight"] = sum(r["grads"]["kv_up_weight"] for r in per_rank)
    return full([r["out"] for r in per_rank]), grads



def compared(results, cp, case_id):
    """``(case_id(case), the ranks' assembled (out, grads), the reference's)`` for each
    ``(case, per-rank results)`` of ``results`` (what ``case_runs.assert_all_match`` takes)."""
    for case, per_rank in results:
        yield case_id(case), assemble(per_rank, case, cp), reference(case["bounds"], case["causal"])

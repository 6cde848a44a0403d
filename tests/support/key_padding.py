"""Key padding for the tests: small MLA inputs at micro-batch 2, right/left padding masks with
a different pad length per sample, and a float64 single-process attention over the full
sequence that applies the mask from its definition (it knows nothing of segments, windows,
kernels or the empty-row fill the forms compute)."""
from __future__ import annotations

import torch

from mindspeed_laga import layout as layouts

S, B, HEADS, D_N, D_R, D_V, D_C = 32, 2, 4, 8, 4, 8, 16
SCALE = (D_N + D_R) ** -0.5
# padding keys per sample (different per sample; left padding leaves rows that see no key)
PAD = {"right": (5, 11), "left": (7, 3), "none": (0, 0)}


def padding_mask(side: str, seq: int = S, pads=None) -> torch.Tensor:
    """[B, seq] bool, True = padding, ``pads[i]`` padding tokens at the ``side`` of sample i."""
    pads = PAD[side] if pads is None else pads
    mask = torch.zeros(len(pads), seq, dtype=torch.bool)
    for i, n in enumerate(pads):
        if n:
            mask[i, seq - n:] = side == "right"
            mask[i, :n] = side == "left"
    return mask


def full_inputs(seed=0, batch=B):
    g = torch.Generator().manual_seed(seed)

    def randn(*size, scale=1.0):
        return torch.randn(*size, generator=g, dtype=torch.float64) * scale

    return {"query": randn(S, batch, HEADS, D_N + D_R), "kv_latent": randn(S, batch, D_C),
            "k_pos_emb": randn(S, batch, D_R),
            "kv_up_weight": randn(HEADS * (D_N + D_V), D_C, scale=D_C ** -0.5),
            "grad_out": randn(S, batch, HEADS * D_V)}


def reference(mask: torch.Tensor, causal: bool = True, empty_rows: str = "mean", seed=0):
    """Float64 attention of the full sequence: key j visible to query i of sample b iff
    (j <= i or not causal) and not mask[b, j]. A row with no visible key: "mean" = a
    softmax over a constant row (every value of the sequence weighted alike, no score
    gradient), "zero" = zero."""
    x = full_inputs(seed, mask.shape[0])
    names = ("query", "kv_latent", "k_pos_emb", "kv_up_weight")
    inputs = {k: x[k].clone().requires_grad_() for k in names}
    q, kv, kpe, w = (inputs[k] for k in names)
    seq, b = kv.shape[:2]
    w3 = w.view(HEADS, D_N + D_V, D_C)
    k_nope = torch.einsum("sbc,ndc->sbnd", kv, w3[:, :D_N])
    value = torch.einsum("sbc,nvc->sbnv", kv, w3[:, D_N:])
    key = torch.cat([k_nope, kpe[:, :, None].expand(seq, b, HEADS, D_R)], dim=-1)
    keep = ~mask[:, None, None, :]                                    # [b, 1, 1, S]
    if causal:
        keep = keep & torch.ones(seq, seq, dtype=torch.bool).tril()    # [b, 1, S, S]
    keep = keep.expand(b, 1, seq, seq)
    empty = ~keep.any(-1, keepdim=True)
    scores = torch.einsum("qbnd,kbnd->bnqk", q, key) * SCALE
    scores = scores.masked_fill(~keep, float("-inf"))
    scores = torch.where(empty, torch.zeros((), dtype=scores.dtype), scores)
    probs = scores.softmax(-1)
    if empty_rows == "zero":
        probs = probs.masked_fill(empty, 0)
    out = torch.einsum("bnqk,kbnv->qbnv", probs, value).reshape(seq, b, HEADS * D_V)
    out.backward(x["grad_out"])
    return out.detach(), {k: v.grad for k, v in inputs.items()}


def local_inputs(x, lay, cp, rank, ulysses_degree=1):
    def local(t):
        return layouts.shard(t, lay, cp, rank, ulysses_degree=ulysses_degree) if cp > 1 else t
    inputs = {k: local(x[k]).clone().requires_grad_() for k in ("query", "kv_latent", "k_pos_emb")}
    return inputs, local


def assemble(per_rank, lay, cp, ulysses_degree=1):
    if cp == 1:
        return per_rank[0]["out"], per_rank[0]["grads"]

    def full(parts):
        return layouts.unshard(parts, lay, ulysses_degree=ulysses_degree)

    grads = {k: full([r["grads"][k] for r in per_rank]) for k in ("query", "kv_latent", "k_pos_emb")}
    grads["kv_up_weight"] = sum(r["grads"]["kv_up_weight"] for r in per_rank)
    return full([r["out"] for r in per_rank]), grads

"""Key padding for the tests: small MLA inputs at micro-batch 2, right/left padding masks with
a different pad length per sample, and a float64 single-process attention over the full
sequence that applies the mask from its definition (it knows nothing of segments, windows,
kernels or the empty-row fill the forms compute)."""
from __future__ import annotations

import torch

from mindspeed_laga import absorbed_attention, count_bytes, explicit_attention, laga_attention
from mindspeed_laga import layout as layouts
from mindspeed_laga.cp_algos import ALGOS

FORMS_BY_NAME = {"explicit": explicit_attention, "absorbed": absorbed_attention,
                 "laga": laga_attention}

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


def reference(mask: torch.Tensor, causal: bool = True, empty_rows: str = "mean", seed=0,
              quiet_empty_rows: bool = False):
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
    out.backward(grad_out(x, dict(side=_side_of(mask), quiet_empty_rows=quiet_empty_rows)))
    return out.detach(), {k: v.grad for k, v in inputs.items()}


def _side_of(mask):
    return next(side for side in PAD if torch.equal(padding_mask(side), mask))


def rows_seeing_no_key(mask: torch.Tensor) -> torch.Tensor:
    """[S, b] bool: causal query rows whose every visible key is padding."""
    return ((~mask).cumsum(dim=1) == 0).t()


def grad_out(x, case):
    """The output gradient of a case; ``quiet_empty_rows``: zero on rows that see no key
    (what a comparison with an additive-mask softmax needs, whose grads there are the
    derivative of a rounded-away term)."""
    g = x["grad_out"]
    if case.get("quiet_empty_rows"):
        g = g.masked_fill(rows_seeing_no_key(padding_mask(case["side"]))[..., None], 0)
    return g


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


def run_case(rank, cp, case, group):
    x = {k: v.to(case.get("dtype", torch.float64)) for k, v in full_inputs().items()}
    degree = 2 if ALGOS[case["cp_algo"]].takes_ulysses_degree else 1
    inputs, local = local_inputs(x, case["layout"], cp, rank, degree)
    weight = x["kv_up_weight"].clone().requires_grad_()
    opts = dict(case["options"])
    extra = {}
    if degree > 1:
        import torch.distributed as dist
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        extra["ulysses_group"] = groups[rank // 2]
    if opts.pop("overlap", False):
        from mindspeed_laga import start_latent_gather
        extra["latent_gather"] = start_latent_gather(inputs["kv_latent"], inputs["k_pos_emb"],
                                                     cp_group=group)
    with count_bytes() as counter:
        out = FORMS_BY_NAME[case["form"]](inputs["query"], inputs["kv_latent"], inputs["k_pos_emb"],
                                  weight, softmax_scale=SCALE, cp_group=group,
                                  cp_algo=case["cp_algo"], layout=case["layout"],
                                  causal=case["causal"], kernel=case["kernel"],
                                  key_padding_mask=padding_mask(case["side"]),
                                  empty_rows=case["empty_rows"], **opts, **extra)
        out.backward(local(grad_out(x, case)))
    grads = {k: v.grad for k, v in inputs.items()}
    grads["kv_up_weight"] = weight.grad
    return {"out": out.detach(), "grads": grads, "bytes": counter.bytes()}


def worker(rank, cp, cases):
    import torch.distributed as dist
    if any(case["kernel"] == "npu" for case in cases):
        from support import fake_torch_npu
        fake_torch_npu.install()
    return [run_case(rank, cp, case, dist.group.WORLD) for case in cases]

"""Sparse MLA (DSA) for the tests: inputs, a single-process reference, the per-rank worker.

The reference works on the whole sequence from the definitions: index scores
``sum_h relu(q_h . k) w_h`` (float32 products, as the host's bf16 path), causal; the top-k
picked row by row with Python's ``sorted`` on (-score, position); dense non-absorbed
attention (K/V rebuilt per head) with every unpicked key masked; the KL loss from the
dense probabilities. It shares no code with mindspeed_laga.sparse.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mindspeed_laga import count_bytes
from mindspeed_laga import layout as layouts
from mindspeed_laga.sparse.form import sparse_laga_attention

S, B, HEADS, D_N, D_R, D_V, D_C, INDEX_HEADS, INDEX_DIM, TOPK = 16, 2, 3, 8, 4, 6, 10, 4, 8, 5
SCALE = (D_N + D_R) ** -0.5
COEFF = 0.3
LOCAL = ("query", "kv_latent", "k_pos_emb", "index_query", "index_key", "index_weights")
NAMES = LOCAL + ("kv_up_weight",)


def full_inputs(seed=0, tie=False, dims=None, index_bf16=False, scales=None):
    """Float64 inputs of the whole sequence (``dims``: overrides of the sizes above);
    ``tie``: every index key the same, so each query's keys all score alike;
    ``index_bf16``: the indexer's inputs rounded to bfloat16 values (still float64), so an
    indexer that casts them to bfloat16 picks what the float64 reference picks;
    ``scales``: {name: factor} multiplying inputs (a power of two keeps bfloat16 values)."""
    d = {**dict(S=S, B=B, HEADS=HEADS, D_N=D_N, D_R=D_R, D_V=D_V, D_C=D_C,
                INDEX_HEADS=INDEX_HEADS, INDEX_DIM=INDEX_DIM), **(dims or {})}
    g = torch.Generator().manual_seed(seed)

    def randn(*size, scale=1.0):
        return torch.randn(*size, generator=g, dtype=torch.float64) * scale

    s, b, n = d["S"], d["B"], d["HEADS"]
    x = {"query": randn(s, b, n, d["D_N"] + d["D_R"]), "kv_latent": randn(s, b, d["D_C"]),
         "k_pos_emb": randn(s, b, d["D_R"]),
         "index_query": randn(s, b, d["INDEX_HEADS"], d["INDEX_DIM"]),
         "index_key": randn(s, b, d["INDEX_DIM"]),
         "index_weights": randn(s, b, d["INDEX_HEADS"]).abs() + 0.1,
         "kv_up_weight": randn(n * (d["D_N"] + d["D_V"]), d["D_C"], scale=d["D_C"] ** -0.5),
         "grad_out": randn(s, b, n * d["D_V"])}
    if tie:
        x["index_key"] = x["index_key"][:1].expand_as(x["index_key"]).clone()
    if index_bf16:
        for name in ("index_query", "index_key", "index_weights"):
            x[name] = x[name].bfloat16().double()
    for name, factor in (scales or {}).items():
        x[name] = x[name] * factor
    return x


def _reference_topk(scores, topk, starts):
    """[b, s, k] picks of [b, s, S] scores: best first, ties to the lowest position, -1 after
    the query's own position or before its document's start (row s sees keys
    starts[s]..s)."""
    b, s, total = scores.shape
    k = min(topk, total)
    out = torch.empty(b, s, k, dtype=torch.long)
    for bi in range(b):
        for i in range(s):
            row = scores[bi, i].tolist()
            ranked = sorted(range(total), key=lambda j: (-row[j], j))[:k]
            out[bi, i] = torch.tensor([j if starts[i] <= j <= i else -1 for j in ranked])
    return out


def document_starts(total, documents=None):
    """Each position's document start (0 for all without documents), from the boundaries."""
    bounds = list(documents or (0, total))
    return [max(b for b in bounds[:-1] if b <= i) for i in range(total)]


def reference(x, topk=TOPK, scale=SCALE, coeff=COEFF, eps=1e-8, all_keys=False, documents=None,
              picks=None):
    """Output, picks, loss and grads (of output . grad_out + loss) of the whole sequence.
    ``documents``: the packed documents' boundaries: a query sees only its document's keys.
    ``picks``: given [b, S, k] picks (a layer reusing another's): no indexer, no loss (0),
    no grad to the index inputs.
    ``eps``: added to both distributions in the KL loss, as the DSA reference does (0: the
    exact KL, as the fused loss op computes it). ``all_keys``: the loss's target from each
    head's unmasked softmax over every key, read at the picks (an empty one: the last
    key), as MindSpeed-LLM's torch loss computes it behind sparse flash attention."""
    inputs = {k: x[k].clone().requires_grad_() for k in NAMES}
    q, kv, kpe, iq, ik, iw, w = (inputs[k] for k in NAMES)
    total, b, n, _ = q.shape
    d_n = w.shape[0] // n - (x["grad_out"].shape[-1] // n)
    d_v = x["grad_out"].shape[-1] // n
    starts = document_starts(total, documents)
    given = picks is not None
    if not given:
        causal = torch.tensor([[starts[i] <= j <= i for j in range(total)]
                               for i in range(total)])
        logits = torch.einsum("sbhd,tbd->bhst", iq.float(), ik.float()).relu()
        scores = (logits * iw.permute(1, 2, 0)[..., None]).sum(1)
        scores = scores.masked_fill(~causal, float("-inf"))
        picks = _reference_topk(scores.detach(), topk, starts)
    valid = picks >= 0
    picked = torch.zeros(b, total, total, dtype=torch.bool)
    for bi in range(b):
        for i in range(total):
            picked[bi, i, picks[bi, i][valid[bi, i]]] = True
    w3 = w.view(n, d_n + d_v, -1)
    key = torch.cat([torch.einsum("sbc,ndc->sbnd", kv, w3[:, :d_n]),
                     kpe[:, :, None].expand(-1, -1, n, -1)], dim=-1)
    value = torch.einsum("sbc,nvc->sbnv", kv, w3[:, d_n:])
    att = torch.einsum("sbnd,tbnd->bnst", q, key) * scale
    probs = att.masked_fill(~picked[:, None], float("-inf")).softmax(-1)
    out = torch.einsum("bnst,tbnv->sbnv", probs, value).reshape(total, b, n * d_v)
    if given:
        ((out * x["grad_out"]).sum()).backward()
        return dict(output=out.detach(), topk_indices=picks, loss=torch.zeros(()),
                    grads={k: v.grad for k, v in inputs.items()})
    if all_keys:
        dist = att.detach().softmax(-1, dtype=torch.float32).sum(1)
        read = torch.where(valid, picks, torch.full_like(picks, total - 1))
        target = F.normalize(torch.gather(dist, -1, read), p=1, dim=-1)
    else:
        dist = probs.detach().float().sum(1)
        target = F.normalize(torch.gather(dist, -1, picks.clamp(min=0)) * valid, p=1, dim=-1)
    predicted = torch.gather(scores, -1, picks.clamp(min=0)).masked_fill(~valid, float("-inf"))
    if eps:
        predicted = predicted.softmax(-1, dtype=torch.float32)
        kl = target * ((target + eps).log() - (predicted + eps).log())
    else:  # the exact KL: the slots with target 0 add nothing
        log_predicted = predicted.log_softmax(-1, dtype=torch.float32)
        kl = torch.where(target > 0, target * (target.log() - log_predicted), torch.zeros_like(target))
    loss = kl.sum(-1).mean() * coeff
    ((out * x["grad_out"]).sum() + loss).backward()
    return dict(output=out.detach(), topk_indices=picks, loss=loss.detach(),
                grads={k: v.grad for k, v in inputs.items()})


def worker(rank, world_size, layout, seeds_ties, topk=TOPK, dims=None, kernels=None,
           index_bf16=False, scales=None, documents=None):
    """LAGA's sparse MLA on this rank's shard of each (seed, tie) input: output, picks,
    loss, the byte counter and grads of (output . grad_out + loss / P), the loss weighted
    as Megatron's average over CP ranks weights it. ``kernels``: the stages' kernel
    arguments (``indexer_kernel`` etc.); ``index_bf16``, ``scales``: as in :func:`full_inputs`;
    ``documents``: the packed documents' boundaries (``cu_seqlens``)."""
    import torch.distributed as dist

    group = dist.group.WORLD
    results = []
    for seed, tie in seeds_ties:
        x = full_inputs(seed, tie, dims, index_bf16, scales)
        local = {k: layouts.shard(x[k], layout, world_size, rank).clone().requires_grad_()
                 for k in LOCAL}
        weight = x["kv_up_weight"].clone().requires_grad_()
        n = x["query"].shape[2]
        d_v = x["grad_out"].shape[-1] // n
        with count_bytes() as counter:
            got = sparse_laga_attention(
                *(local[k] for k in LOCAL[:3]), weight, *(local[k] for k in LOCAL[3:]),
                index_topk=topk, softmax_scale=SCALE, qk_head_dim=x["query"].shape[-1] -
                x["k_pos_emb"].shape[-1], v_head_dim=d_v, cp_group=group, layout=layout,
                indexer_loss_coeff=COEFF, cu_seqlens=documents, **(kernels or {}))
            grad_out = layouts.shard(x["grad_out"], layout, world_size, rank)
            ((got.output * grad_out).sum() + got.indexer_loss / world_size).backward()
        grads = {k: v.grad for k, v in local.items()}
        grads["kv_up_weight"] = weight.grad
        results.append(dict(output=got.output.detach(), topk_indices=got.topk_indices,
                            loss=got.indexer_loss.detach(), grads=grads,
                            records=[(r.kind, r.direction, r.payload) for r in counter.records]))
    return results


def assemble(per_rank, index, layout):
    """One case's per-rank results as whole-sequence tensors (weight grads summed, losses
    averaged, as Megatron's reduction over CP makes them)."""
    runs = [ranks[index] for ranks in per_rank]

    def seq(tensors, dim=0):
        return layouts.unshard(list(tensors), layout, dim=dim)

    grads = {k: seq([r["grads"][k] for r in runs]) for k in LOCAL}
    grads["kv_up_weight"] = sum(r["grads"]["kv_up_weight"] for r in runs)
    return dict(output=seq([r["output"] for r in runs]),
                topk_indices=seq([r["topk_indices"] for r in runs], dim=1),
                loss=sum(r["loss"] for r in runs) / len(runs), grads=grads)


def refusal_worker(rank, world_size, local_len, layout, dtype=None):
    """One call on ``local_len`` tokens of this rank (``dtype``: the inputs cast to it):
    (the ValueError's message or None, the data collectives the byte counter saw: the
    ranks' agreement, which carries the refusal to every rank, is no data collective)."""
    import torch.distributed as dist

    x = full_inputs(0, dims={"S": local_len * world_size})
    local = {k: layouts.shard(x[k], "contiguous", world_size, rank) for k in LOCAL}
    local["kv_up_weight"] = x["kv_up_weight"]
    if dtype is not None:
        local = {k: v.to(getattr(torch, dtype)) for k, v in local.items()}
    message = None
    with count_bytes() as counter:
        try:
            sparse_laga_attention(*(local[k] for k in LOCAL[:3]), local["kv_up_weight"],
                                  *(local[k] for k in LOCAL[3:]), index_topk=TOPK,
                                  softmax_scale=SCALE, qk_head_dim=D_N, v_head_dim=D_V,
                                  cp_group=dist.group.WORLD, layout=layout)
        except ValueError as exc:
            message = str(exc)
    return message, [(r.kind, r.direction) for r in counter.records if r.kind != "handshake"]

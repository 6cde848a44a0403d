"""Two sparse MLA layers over the same tokens, the second reusing the first's picks
(GLM-5.2's shared top-k), for tests/core/test_sparse_given_picks.py.

The computing layer runs the indexer and its loss on inputs of seed ``seed``; the reusing
one, on other inputs (seed ``seed + 1``), takes ``topk_indices`` from the first call's
result. Each call's forward bytes are counted apart, the backward's together.
"""
from __future__ import annotations

from mindspeed_laga import count_bytes
from mindspeed_laga import layout as layouts
from mindspeed_laga.sparse.form import sparse_laga_attention

from .sparse_mla import COEFF, LOCAL, SCALE, TOPK, full_inputs

MLA = LOCAL[:3]  # the inputs a reusing layer takes: query, kv_latent, k_pos_emb


def chain_worker(rank, world_size, layout, seed, dims=None, micro_batch=False):
    """[computing layer's results, reusing layer's]: output, picks, loss, grads, and the
    byte counter's records of its forward; plus the backward's records. ``micro_batch``:
    both layers in one micro-batch (the reusing one a later call), settled after."""
    import torch.distributed as dist

    from mindspeed_laga import new_micro_batch, settle
    group = dist.group.WORLD
    if micro_batch:
        new_micro_batch(group)
    runs, backward = [], 0
    for layer, names in ((0, LOCAL), (1, MLA)):
        x = full_inputs(seed + layer, dims=dims)
        local = {k: layouts.shard(x[k], layout, world_size, rank).clone().requires_grad_()
                 for k in names}
        weight = x["kv_up_weight"].clone().requires_grad_()
        index = [local[k] for k in LOCAL[3:]] if layer == 0 else [None] * 3
        with count_bytes() as counter:
            got = sparse_laga_attention(
                *(local[k] for k in MLA), weight, *index, index_topk=TOPK, softmax_scale=SCALE,
                qk_head_dim=x["query"].shape[-1] - x["k_pos_emb"].shape[-1],
                v_head_dim=x["grad_out"].shape[-1] // x["query"].shape[2], cp_group=group,
                layout=layout, indexer_loss_coeff=COEFF if layer == 0 else None,
                topk_indices=runs[0]["result"].topk_indices if layer else None)
        grad_out = layouts.shard(x["grad_out"], layout, world_size, rank)
        objective = (got.output * grad_out).sum()
        if got.indexer_loss is not None:
            objective = objective + got.indexer_loss / world_size
        backward = backward + objective
        runs.append(dict(result=got, local=local, weight=weight,
                         records=[(r.kind, r.direction, r.payload) for r in counter.records]))
    with count_bytes() as counter:
        backward.backward()
    if micro_batch:
        settle()
    out = []
    for run in runs:
        got = run["result"]
        grads = {k: v.grad for k, v in run["local"].items()}
        grads["kv_up_weight"] = run["weight"].grad
        out.append(dict(output=got.output.detach(), topk_indices=got.topk_indices,
                        loss=None if got.indexer_loss is None else got.indexer_loss.detach(),
                        grads=grads, records=run["records"]))
    return out, [(r.kind, r.direction, r.payload) for r in counter.records]

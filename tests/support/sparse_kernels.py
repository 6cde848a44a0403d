"""The sparse MLA stage kernels (mindspeed_laga/sparse/) for the tests: DSA's op dims, the stage
combinations, the per-rank workers with the fused-op stand-ins installed as torch_npu.

The fused ops take kv latent 512, rope 64, index head dim 128 and (the loss) 8+ heads and
8+ index heads; the stand-ins run them in float64 inside ``wide_dtypes()``. The index
inputs are bfloat16 values (kept float64), so the npu indexer's bfloat16 cast loses
nothing and its picks are the float64 reference's.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from mindspeed_laga.sparse.form import sparse_laga_attention
from mindspeed_laga.sparse.registry import SPARSE_KERNELS, sparse_kernel
from support import fake_dsa_ops, fake_torch_npu
from support import sparse_mla as sm

DIMS = dict(S=32, B=2, HEADS=8, D_N=16, D_R=64, D_V=16, D_C=512, INDEX_HEADS=8, INDEX_DIM=128)
TOPK = 6  # < S: early rows have fewer keys than picks, so -1 picks occur
SEED = 0
STAGES = ("indexer_kernel", "attention_kernel", "loss_kernel")
# (indexer, attention, loss): every combination of the registered kernels
COMBOS = list(itertools.product(SPARSE_KERNELS, repeat=len(STAGES)))


def rounded(combo) -> bool:
    """The loss reads top-k scores its indexer rounded (the npu indexer's bfloat16 into
    the torch loss): its loss and index grads as close as those scores allow; every other
    combination is exact against the float64 reference."""
    indexer, _, loss = (sparse_kernel(name) for name in combo)
    return indexer.rounds_index_scores and loss.loss_reads_index_scores


EXACT = [combo for combo in COMBOS if not rounded(combo)]
ROUNDED = [combo for combo in COMBOS if rounded(combo)]


# the index query and rope key scaled by powers of two (exact in bfloat16) so that
# neither softmax is one-hot at D = 128 and d_r = 64
SCALES = {"index_query": 1 / 8, "k_pos_emb": 1 / 4}


def inputs():
    return sm.full_inputs(SEED, dims=DIMS, index_bf16=True, scales=SCALES)


def kernels(combo):
    return dict(zip(STAGES, combo))


def worker(rank, world_size, layout, combos):
    """sm.worker for each combination, the stand-ins installed: {combo: result}."""
    fake_torch_npu.install()
    with fake_dsa_ops.wide_dtypes():
        return {combo: sm.worker(rank, world_size, layout, [(SEED, False)], TOPK, DIMS,
                                 kernels(combo), True, SCALES)[0] for combo in combos}


def heads_of(x, rank, size):
    """This TP rank's heads: of the query, the up-projection's rows and the output grad."""
    n, d_v = DIMS["HEADS"], DIMS["D_V"]
    per = n // size
    heads = slice(rank * per, (rank + 1) * per)
    weight = x["kv_up_weight"].view(n, -1, x["kv_up_weight"].shape[-1])[heads]
    grad_out = x["grad_out"].view(*x["grad_out"].shape[:2], n, d_v)[:, :, heads]
    return x["query"][:, :, heads], weight.reshape(-1, weight.shape[-1]), grad_out.flatten(2)


def tp_worker(rank, world_size, combos):
    """The whole sequence (no CP) with the heads split over the ranks as a TP group,
    ``loss_tp_group`` that group: {combo: output, loss, grads} of this rank."""
    fake_torch_npu.install()
    out = {}
    with fake_dsa_ops.wide_dtypes():
        for combo in combos:
            x = inputs()
            query, weight, grad_out = heads_of(x, rank, world_size)
            local = {k: x[k].clone().requires_grad_() for k in sm.LOCAL}
            local["query"] = query.clone().requires_grad_()
            local["kv_up_weight"] = weight.clone().requires_grad_()
            got = sparse_laga_attention(
                *(local[k] for k in sm.LOCAL[:3]), local["kv_up_weight"],
                *(local[k] for k in sm.LOCAL[3:]), index_topk=TOPK, softmax_scale=sm.SCALE,
                qk_head_dim=DIMS["D_N"], v_head_dim=DIMS["D_V"], layout="contiguous",
                indexer_loss_coeff=sm.COEFF, loss_tp_group=dist.group.WORLD, **kernels(combo))
            ((got.output * grad_out).sum() + got.indexer_loss).backward()
            out[combo] = dict(output=got.output.detach(), loss=got.indexer_loss.detach(),
                              grads={k: v.grad for k, v in local.items()})
    return out

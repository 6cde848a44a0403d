"""Sparse MLA joins the ranks' agreement (mindspeed_laga/agreement/): the values every
CP rank must pass alike (index_topk, the index widths, the loss target and coefficient,
each stage's kernel, the local length, layout, dtype, requires-grad pattern) are
exchanged before the gather, so ranks that differ raise together, naming the argument,
instead of running silently (different picks per rank) or aborting in gloo (different
lengths). Each case is one spawned job of two gloo ranks, bounded by its timeout.
"""
from __future__ import annotations

import pytest
import torch

from mindspeed_laga import count_bytes, new_micro_batch
from mindspeed_laga import layout as layouts
from mindspeed_laga.sparse.form import sparse_laga_attention
from mindspeed_laga.tools.spawn import run_on_ranks
from support.sparse_mla import COEFF, SCALE, TOPK, D_N, D_V, full_inputs

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

LOCAL = ("query", "kv_latent", "k_pos_emb", "kv_up_weight", "index_query", "index_key",
         "index_weights")


def _call(rank, layout="contiguous", **kw):
    import torch.distributed as dist
    x = full_inputs()
    if kw.pop("short", False):
        x = {k: (v if k == "kv_up_weight" else v[:12]) for k, v in x.items()}
    tensors = [x[k] if k == "kv_up_weight" else layouts.shard(x[k], layout, 2, rank)
               for k in LOCAL]
    if kw.pop("float32", False):
        tensors = [t.float() for t in tensors]
    if kw.pop("index_grad", False):  # the index query needs a grad on this rank only
        tensors[4] = tensors[4].detach().requires_grad_()
    options = dict(index_topk=TOPK, softmax_scale=SCALE, qk_head_dim=D_N, v_head_dim=D_V,
                   cp_group=dist.group.WORLD, layout=layout, indexer_loss_coeff=COEFF)
    options.update(kw)
    with count_bytes() as counter:
        try:
            sparse_laga_attention(*tensors, **options)
            error = None
        except ValueError as exc:
            error = str(exc)
    return error, counter.bytes()


CASES = {  # name -> (rank 1's change, what the message names)
    "index_topk": (dict(index_topk=TOPK + 1), "index_topk: [5, 6]"),
    "local length": (dict(short=True), "the local sequence length: [8, 6]"),
    "loss target": (dict(loss_target="all_keys"), "loss_target: ['picks', 'all_keys']"),
    "loss coefficient": (dict(indexer_loss_coeff=COEFF * 1.01), "indexer_loss_coeff"),
    "indexer kernel": (dict(indexer_kernel="npu"), "indexer_kernel"),  # refused here: no NPU
    "layout": (dict(layout="zigzag"), "layout"),
    "dtype": (dict(float32=True), "dtype"),
    "index grads": (dict(index_grad=True), "need grads (requires_grad under grad mode): "
                                           "[[], ['index_query']]"),
}


def _worker(rank, world, name, in_micro_batch):
    if in_micro_batch:
        import torch.distributed as dist
        new_micro_batch(dist.group.WORLD)
    return _call(rank, **(CASES[name][0] if rank == 1 else {}))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("in_micro_batch", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_sparse_ranks_that_disagree_raise_together_before_the_gather(name, in_micro_batch):
    results = run_on_ranks(_worker, 2, name, in_micro_batch, timeout_s=120)
    needle = CASES[name][1]
    for rank, (error, moved) in enumerate(results):
        assert error and (needle in error or "rejected their arguments" in error), \
            (rank, results)
        assert moved == 0, (rank, results)  # no data collective ran
    assert any(needle in error for error, _ in results), results

"""Hybrid CP over packed documents in the contiguous layout: MindSpeed's split for
``--attention-mask-type general`` (ring slice, then Ulysses piece: CP slice r*U + u),
against the float64 single-process attention of tests/support/documents.py.

Documents of a fixed length (``--fix-sub-seq-length``: 32 tokens in 12, 12, 8) and ragged
ones; at CP 4 every rank holds 8 tokens, so ends fall inside ranks' slices and inside
Ulysses groups.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mindspeed_laga import comm, laga_attention
from mindspeed_laga import layout as layouts
from mindspeed_laga.tools.spawn import run_on_ranks
from support import case_runs
from support.documents import SCALE, full_inputs, reference

WORLD, DEGREE = 4, 2
DOCUMENTS = {"fixed-12": [0, 12, 24, 32], "ragged": [0, 5, 19, 32]}
OPTIONS = {"plain": {}, "recompute-blocks": {"recompute_kv": True, "kv_block_size": 5}}
CASES = [(docs, opts) for docs in DOCUMENTS for opts in OPTIONS]


def run_case(rank, bounds, options):
    x = full_inputs()
    ulysses_group = comm.ulysses_group(dist.group.WORLD, DEGREE)

    def local(t):
        return layouts.shard(t, "contiguous", WORLD, rank, ulysses_degree=DEGREE)

    inputs = {k: local(x[k]).clone().requires_grad_() for k in ("query", "kv_latent", "k_pos_emb")}
    weight = x["kv_up_weight"].clone().requires_grad_()
    out = laga_attention(inputs["query"], inputs["kv_latent"], inputs["k_pos_emb"], weight,
                         softmax_scale=SCALE, cp_group=dist.group.WORLD, cp_algo="hybrid",
                         layout="contiguous", kernel="eager", ulysses_group=ulysses_group,
                         cu_seqlens=bounds, **options)
    out.backward(local(x["grad_out"]))
    grads = {k: v.grad for k, v in inputs.items()}
    grads["kv_up_weight"] = weight.grad
    return {"out": out.detach(), "grads": grads}


def worker(rank, world):
    return [run_case(rank, DOCUMENTS[docs], OPTIONS[opts]) for docs, opts in CASES]


def compared(per_rank):
    for i, (docs, opts) in enumerate(CASES):
        parts = [r[i] for r in per_rank]

        def full(key, parts=parts):
            return layouts.unshard([p[key] if key == "out" else p["grads"][key] for p in parts],
                                   "contiguous", ulysses_degree=DEGREE)

        grads = {k: full(k) for k in ("query", "kv_latent", "k_pos_emb")}
        grads["kv_up_weight"] = sum(p["grads"]["kv_up_weight"] for p in parts)
        yield f"{docs}-{opts}", (full("out"), grads), reference(DOCUMENTS[docs], causal=True)


@pytest.mark.timeout(300)
def test_hybrid_contiguous_documents_match_reference():
    per_rank = run_on_ranks(worker, WORLD, timeout_s=240)
    case_runs.assert_all_match(compared(per_rank), tolerance=1e-10)


def test_the_split_is_the_ring_slice_then_the_ulysses_piece():
    """MindSpeed's _get_batch_on_this_cp_rank_in_hybrid_cp_general: chunk over the R ring
    ranks, then over the U Ulysses ranks (written out here, not imported)."""
    seq = torch.arange(32)
    for rank in range(WORLD):
        ring, u = divmod(rank, DEGREE)
        host = seq.chunk(WORLD // DEGREE)[ring].chunk(DEGREE)[u]
        assert torch.equal(layouts.shard(seq, "contiguous", WORLD, rank, ulysses_degree=DEGREE),
                           host)

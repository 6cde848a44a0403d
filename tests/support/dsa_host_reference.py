"""References for the DSA op stand-ins from MindSpeed-LLM's own non-fused torch path.

Run as a script (the host sources on sys.path would shadow the installed megatron-core in
the test process): ``python tests/support/dsa_host_reference.py OUT.pt`` with
MEGATRON_SRC, MINDSPEED_SRC and MINDSPEED_LLM_SRC set (tests/support/thirdparty.py).
It draws seeded inputs and saves them with what the host's functions of
``tasks/models/transformer/dsa_indexer.py`` make of them:

- ``DSAIndexer.forward_with_scores`` without the fused indexer (``bf16_index``, the causal
  mask, ``topk``, -1 for slots past the causal limit): top-k indices and scores, and the
  grads of query, key and weights of ``sum(scores * probe)`` over the valid slots;
- ``DSAIndexer.generate_sparse_mask`` (the boolean form taken with flash attention):
  the sparse mask (its ``scatter_`` takes no -1 on CPU: see ``attention_reference``);
  the attention output (plain softmax attention over the absorbed MQA scores under
  that mask, written here) and its grads;
- ``get_attn_scores`` and ``compute_dsa_indexer_loss``: the indexer's KL loss and the
  grads of the indexer's query, key and weights;
- the host's fused callers run on the stand-ins (``fused_callers``), so the tests see
  that the host's own calls go through them as on the NPU.
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch

B, S, HEADS, INDEX_HEADS, TOPK = 2, 16, 8, 8, 6
INDEX_DIM, LATENT, ROPE = 128, 512, 64
SCALE = 0.11


def inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale)

    return {  # Megatron's [S, B, ...] order, as the host functions take them
        "index_q": randn(S, B, INDEX_HEADS, INDEX_DIM, scale=0.3),
        "index_k": randn(S, B, 1, INDEX_DIM, scale=0.3),
        "weights": randn(S, B, INDEX_HEADS, scale=0.5),
        "probe": randn(B, S, TOPK),
        "q": randn(S, B, HEADS, LATENT, scale=0.2),
        "q_rope": randn(S, B, HEADS, ROPE, scale=0.2),
        "latent": randn(S, B, 1, LATENT, scale=0.2),
        "k_rope": randn(S, B, 1, ROPE, scale=0.2),
        "grad_out": randn(S, B, HEADS, LATENT),
    }


def _host(use_flash_attn: bool):
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer
    from megatron.training import global_vars

    args = SimpleNamespace(use_fused_lightning_indexer=False, use_sparse_flash_attn=False,
                           use_flash_attn=use_flash_attn, sparse_mode=0)
    global_vars._GLOBAL_ARGS = args
    parallel_state._GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()
    parallel_state.set_tensor_model_parallel_world_size(1)
    from mindspeed_llm.tasks.models.transformer import dsa_indexer
    return dsa_indexer


def indexer_reference(x: dict) -> dict:
    host = _host(use_flash_attn=True)
    q, k, w = (x[n].float().requires_grad_() for n in ("index_q", "index_k", "weights"))
    hidden = torch.zeros(S, B, 1)
    indices, scores = host.DSAIndexer.forward_with_scores(hidden, q, k, w, None, None, 0, TOPK)
    valid = indices >= 0
    (torch.where(valid, scores, 0.0) * x["probe"].float()).sum().backward()
    return {"indices": indices, "scores": scores.detach(), "d_index_q": q.grad, "d_index_k": k.grad,
            "d_weights": w.grad}


def attention_reference(x: dict, indices: torch.Tensor) -> dict:
    """Dense softmax attention (K = V = latent, rope concatenated) under the host's sparse mask."""
    host = _host(use_flash_attn=True)
    # scatter_ rejects the -1 slots on CPU; a row with -1 slots has all its causal keys
    # selected, itself included, so its own position is a no-op stand-in for them
    own = torch.arange(S).view(1, S, 1).expand_as(indices)
    mask = host.DSAIndexer.generate_sparse_mask(torch.where(indices < 0, own, indices), None, (B, S, S),
                                                torch.float64, "cpu")  # [B, 1, S, S], True = masked
    leaves = {n: x[n].clone().requires_grad_() for n in ("q", "q_rope", "latent", "k_rope")}
    query = torch.cat([leaves["q"], leaves["q_rope"]], -1).permute(1, 2, 0, 3)       # [B, N, S, 576]
    key = torch.cat([leaves["latent"], leaves["k_rope"]], -1).permute(1, 2, 0, 3)    # [B, 1, S, 576]
    scores = (query @ key.transpose(-1, -2) * SCALE).masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, -1)
    out = (probs @ leaves["latent"].permute(1, 2, 0, 3)).permute(2, 0, 1, 3)           # [S, B, N, 512]
    (out * x["grad_out"]).sum().backward()
    return {"mask": mask, "out": out.detach(), **{f"d_{n}": t.grad for n, t in leaves.items()}}


def loss_reference(x: dict, mask: torch.Tensor) -> dict:
    host = _host(use_flash_attn=True)
    q, k, w = (x[n].float().requires_grad_() for n in ("index_q", "index_k", "weights"))
    indices, scores = host.DSAIndexer.forward_with_scores(torch.zeros(S, B, 1), q, k, w, None, None, 0, TOPK)
    query = torch.cat([x["q"], x["q_rope"]], -1)
    key = torch.cat([x["latent"], x["k_rope"]], -1)
    main_dist = host.get_attn_scores(query, key, mask, HEADS, SCALE)
    loss = host.compute_dsa_indexer_loss(main_dist, scores, indices, 1.0)
    loss.backward()
    return {"loss": loss.detach(), "loss_d_index_q": q.grad, "loss_d_index_k": k.grad,
            "loss_d_weights": w.grad}


def fused_callers(x: dict, indices: torch.Tensor) -> dict:
    """The host's own fused callers on the stand-ins: ``fused_lightning_indexer``, its
    kvallgather twin at CP 1 (two query halves against key prefixes: S1 < S2),
    ``fused_sparse_flash_attention_kvallgather`` at CP 1 (likewise; K = V = the latent)
    and ``fused_sparse_lightning_indexer_kl_loss`` (LILossTrain), with their grads."""
    host = _host(use_flash_attn=True)
    from megatron.core import parallel_state
    parallel_state.get_context_parallel_group = lambda *a, **k: torch.distributed.group.WORLD
    parallel_state.get_context_parallel_world_size = lambda *a, **k: 1
    parallel_state.get_context_parallel_rank = lambda *a, **k: 0
    q, k, w = (x[n].float() for n in ("index_q", "index_k", "weights"))
    fused, _ = host.fused_lightning_indexer(q, k, w, TOPK)
    halves, _ = host.fused_lightning_indexer_kvallgather(q, k, w, TOPK)
    rounded = [t.bfloat16().float() for t in (q, k, w)]
    torch_path, _ = host.DSAIndexer.forward_with_scores(torch.zeros(S, B, 1), *rounded, None, None, 0, TOPK)
    import torch_npu
    bsnd = [x[n].transpose(0, 1).contiguous() for n in ("q", "latent", "latent", "q_rope", "k_rope")]
    _, smax, ssum = torch_npu.npu_sparse_flash_attention(
        *bsnd[:3], indices.unsqueeze(2).to(torch.int32), SCALE, query_rope=bsnd[3], key_rope=bsnd[4],
        attention_mode=2, return_softmax_lse=True)
    leaves = {n: x[n].clone().requires_grad_() for n in ("index_q", "index_k", "weights")}
    loss = host.fused_sparse_lightning_indexer_kl_loss(
        x["q"], x["latent"], leaves["index_q"], leaves["index_k"], leaves["weights"],
        indices.to(torch.int32), smax, ssum, SCALE, query_rope=x["q_rope"], key_rope=x["k_rope"])
    loss.backward()
    attn = {n: x[n].clone().requires_grad_() for n in ("q", "q_rope", "latent", "k_rope")}
    out, _, _ = host.fused_sparse_flash_attention_kvallgather(
        attn["q"], attn["latent"], attn["latent"], indices, attn["q_rope"], attn["k_rope"], SCALE,
        torch.distributed.group.WORLD)
    (out * x["grad_out"]).sum().backward()
    found = {"fused_out": out.detach(), **{f"fused_d_{n}": t.grad for n, t in attn.items()}}
    found.update(fused_indices=fused, kvallgather_indices=halves, rounded_torch_indices=torch_path)
    return {**found, "fused_loss": loss.detach(),
            **{f"fused_loss_d_{n}": t.grad for n, t in leaves.items()}}


def main(path: str) -> None:
    from support import fake_dsa_ops, mindspeed_llm_real
    mindspeed_llm_real.prepare(register_laga=False)
    import torch_npu  # prepare()'s import stub: the DSA ops join it
    for name, op in fake_dsa_ops.OPS.items():
        setattr(torch_npu, name, op)
    os.environ[fake_dsa_ops.WIDE_ENV] = "1"  # float64 through LILossTrain
    torch.distributed.init_process_group("gloo", init_method=f"file://{path}.rendezvous", rank=0,
                                         world_size=1)
    x = inputs()
    found = indexer_reference(x)
    found.update(attention_reference(x, found["indices"]))
    found.update(loss_reference(x, found["mask"]))
    found.update(fused_callers(x, found["indices"]))
    torch.save({"inputs": x, "host": found}, path)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1])

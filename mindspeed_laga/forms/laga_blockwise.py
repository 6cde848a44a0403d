"""LAGA with K/V rebuilt blockwise and recomputed in backward.

The paper's LAGA keeps per-head K/V of every key for backward: [S, h, d_qk+d_v]
per rank, the largest activation of the block at long sequence. Every rank
already holds the gathered latent (d_c + d_r per token), so K/V can be
rebuilt when needed instead of kept.

Forward walks the (position-ordered) keys in blocks of ``block_size``:
rebuild the block's K/V from the latent, attend every query segment that can
see the block, and merge with an online softmax (running max and sum, as
ring/flash attention do). Only ``q``, the gathered latent, the output and
the float32 log-sum-exp are saved. Backward walks the blocks again, rebuilds
each block's K/V, forms the block's probabilities from the saved
log-sum-exp, and pushes dK/dV straight back through the up-projection to
the latent and ``kv_up_weight``. Full-sequence K/V never exist, in forward
or backward.

Each (block, query rows) pair goes to a block kernel (``block_kernels``):
eager math with one block's scores materialized, or ``npu_fusion_attention``
and ``npu_fusion_attention_grad``, whose softmax statistics merge blocks the
same way. Accumulation is float32 for half-precision inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from ..layout import Segment
from .block_kernels import block_kernel
from .common import rebuild_kv


@dataclass(frozen=True)
class BlockPlan:
    qk_head_dim: int
    rope_dim: int
    v_head_dim: int
    kv_lora_rank: int
    scale: float
    causal: bool
    segments: Tuple[Segment, ...]
    block_size: int
    kernel: str = "eager"        # per-block kernel: "eager" or "npu" (block_kernels.py)
    pad_v: bool = False          # kernel "npu": V zero-padded to the q/k head dim for the op


def blocks(plan: BlockPlan, num_keys: int):
    """Key blocks [k0, k1) to rebuild, in position order (causal prefix trimming
    has already cut the latent to the keys some query sees)."""
    return [(k0, min(k0 + plan.block_size, num_keys)) for k0 in range(0, num_keys, plan.block_size)]


def visible_rows(plan: BlockPlan, k0: int, k1: int):
    """(query rows, key end, diagonal) for each segment that sees a key of [k0, k1).

    Rows whose position is before ``k0`` see nothing of the block and are cut,
    so every row handed to a block kernel has at least one visible key; keys
    after the segment's last position are cut too (``key end`` is relative to
    ``k0``), so no work is spent on keys the causal mask hides from all rows.
    ``diagonal`` is the block kernels' visibility description
    (``block_kernels``): key j of the cut block is visible to row i iff
    ``j <= i + diagonal``; None when every key is visible to every row.
    """
    for start, n, g in plan.segments:
        first = max(0, k0 - g) if plan.causal else 0
        if first >= n:
            continue
        end = min(k1, g + n) if plan.causal else k1
        diagonal = g + first - k0  # row i sits at position g + first + i, key j at k0 + j
        yield slice(start + first, start + n), end - k0, (
            diagonal if plan.causal and diagonal < end - k0 - 1 else None)


def rebuild(latent_block: torch.Tensor, kv_up_weight: torch.Tensor, plan: BlockPlan):
    """[B, b, d_c + d_r] -> K [b, h, B, d_n + d_r], V [b, h, B, d_v] (Megatron's math)."""
    kv_c, k_pe = torch.split(latent_block, [plan.kv_lora_rank, plan.rope_dim], dim=-1)
    key, value = rebuild_kv(kv_c, k_pe, kv_up_weight, plan.qk_head_dim, plan.v_head_dim)
    return key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)


def blockwise_forward(q, latent, kv_up_weight, plan: BlockPlan):
    """Attention over rebuilt key blocks, merged by log-sum-exp -> (out, lse float32)."""
    kernel = block_kernel(plan.kernel, plan.pad_v)
    b, h, s_q, _ = q.shape
    out = torch.zeros(b, h, s_q, plan.v_head_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s_q), float("-inf"), dtype=torch.float32, device=q.device)
    for k0, k1 in blocks(plan, latent.shape[0]):
        key, value = rebuild(latent[k0:k1], kv_up_weight, plan)
        for rows, end, diagonal in visible_rows(plan, k0, k1):
            block_out, block_lse = kernel.forward(q[:, :, rows], key[:, :, :end], value[:, :, :end],
                                                  diagonal, plan.scale)
            new_lse = torch.logaddexp(lse[:, :, rows], block_lse)
            out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - new_lse).unsqueeze(-1)
                               + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
            lse[:, :, rows] = new_lse
    return out.to(q.dtype), lse


def blockwise_backward(q, latent, kv_up_weight, out, lse, d_out, plan: BlockPlan):
    """Grads of q, the gathered latent and kv_up_weight, one rebuilt key block at a time."""
    kernel = block_kernel(plan.kernel, plan.pad_v)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    d_latent = torch.zeros(latent.shape, dtype=torch.float32, device=q.device)
    d_weight = torch.zeros(kv_up_weight.shape, dtype=torch.float32, device=q.device)
    for k0, k1 in blocks(plan, latent.shape[0]):
        key, value = rebuild(latent[k0:k1], kv_up_weight, plan)
        d_key = torch.zeros(key.shape, dtype=torch.float32, device=q.device)
        d_value = torch.zeros(value.shape, dtype=torch.float32, device=q.device)
        for rows, end, diagonal in visible_rows(plan, k0, k1):
            dq_b, dk_b, dv_b = kernel.backward(q[:, :, rows], key[:, :, :end], value[:, :, :end],
                                               diagonal, plan.scale, d_out[:, :, rows], out[:, :, rows],
                                               lse[:, :, rows])
            dq[:, :, rows] += dq_b
            d_key[:, :, :end] += dk_b
            d_value[:, :, :end] += dv_b
        _through_rebuild(latent[k0:k1], kv_up_weight, d_key, d_value, d_latent[k0:k1], d_weight, plan)
    return dq.to(q.dtype), d_latent.to(latent.dtype), d_weight.to(kv_up_weight.dtype)


def _through_rebuild(latent_block, kv_up_weight, d_key, d_value, d_latent_block, d_weight, plan):
    """Backward of :func:`rebuild`: dK, dV [b,h,B,.] -> latent block and weight grads."""
    d_nope, d_pe = torch.split(d_key, [plan.qk_head_dim, plan.rope_dim], dim=-1)
    d_kv = torch.cat([d_nope, d_value], dim=-1).permute(2, 0, 1, 3)  # [B, b, h, d_n + d_v]
    d_kv = d_kv.reshape(*d_kv.shape[:2], -1)
    kv_c = latent_block[..., :plan.kv_lora_rank].float()
    d_latent_block[..., :plan.kv_lora_rank] = torch.matmul(d_kv, kv_up_weight.float())
    d_latent_block[..., plan.kv_lora_rank:] = d_pe.sum(dim=1).permute(1, 0, 2)
    d_weight += torch.matmul(d_kv.reshape(-1, d_kv.shape[-1]).t(), kv_c.reshape(-1, kv_c.shape[-1]))


class BlockwiseLAGA(torch.autograd.Function):
    """Autograd boundary: saves q, the gathered latent, the output and the lse only."""

    @staticmethod
    def forward(ctx, q, latent, kv_up_weight, plan: BlockPlan):
        out, lse = blockwise_forward(q, latent, kv_up_weight, plan)
        ctx.save_for_backward(q, latent, kv_up_weight, out, lse)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, latent, kv_up_weight, out, lse = ctx.saved_tensors
        dq, d_latent, d_weight = blockwise_backward(q, latent, kv_up_weight, out, lse,
                                                    d_out.contiguous(), ctx.plan)
        return dq, d_latent, d_weight, None

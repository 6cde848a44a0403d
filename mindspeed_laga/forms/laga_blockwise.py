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

Each (block, query rows) pair goes to a block kernel (``block_kernels``; with
documents, all runs of one query segment in a block go at once to a kernel
that offers the packed entry):
eager math with one block's scores materialized, or ``npu_fusion_attention``
and ``npu_fusion_attention_grad``, whose softmax statistics merge blocks the
same way. Accumulation is float32 for half-precision inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..kernels import KeyIndex
from ..vocab import Documents, Segment, doc_pieces, key_blocks, key_window
from .block_kernels import acc_dtype, block_kernel
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
    block_size: Optional[int]    # keys per rebuilt block; None = one block
    kernel: str = "eager"        # per-block kernel (block_kernels.py)
    pad_v: bool = False          # kernel "npu": V zero-padded to the q/k head dim for the op
    documents: Documents = None  # cu_seqlens: a query sees only its own document
    key_ranges: Optional[Tuple[Tuple[int, int], ...]] = None  # positions the latent holds


def visible_rows(plan: BlockPlan, k0: int, k1: int):
    """(query rows, key slice, diagonal) for each run of rows that sees a key of [k0, k1).

    Runs are the query segments cut at document boundaries. A run sees the keys
    of its document up to its own positions (causal) or all of them, and
    nothing else, so a block with no visible (query, key) pair makes no call.
    Rows before the block's first visible key are cut, so every row handed to
    a block kernel sees at least one key; keys no row of the run sees are cut
    too (the key slice is relative to ``k0``). ``diagonal`` is the block
    kernels' visibility (``block_kernels``): key j of the slice is visible to
    row i of the run iff ``j <= i + diagonal``; None when every key is.
    """
    for runs in segment_runs(plan, k0, k1):
        yield from runs


def segment_runs(plan: BlockPlan, k0: int, k1: int):
    """The runs of :func:`visible_rows` grouped by query segment: one non-empty list per
    segment that sees the block, runs in row order (one per document it crosses)."""
    # Untrimmed, key index = position, and a window's end past k1 is cut anyway.
    keys = KeyIndex(plan.key_ranges, k1) if plan.key_ranges else None
    total = plan.key_ranges[-1][1] if plan.key_ranges else k1
    for seg in plan.segments:
        runs = [run for piece in doc_pieces(seg, plan.documents)
                if (run := _run(plan, piece, keys, total, k0, k1)) is not None]
        if runs:
            yield runs


def _run(plan: BlockPlan, piece, keys, total: int, k0: int, k1: int):
    local, n, g = piece
    lo, hi = key_window(piece, total, plan.causal, plan.documents)
    base = keys.index(lo) - lo if keys else 0  # key index of position p: base + p
    a, e = max(k0, base + lo), min(k1, base + hi)
    if a >= e:
        return None
    first = max(0, a - (base + g)) if plan.causal else 0
    if first >= n:
        return None
    diagonal = base + g + first - a if plan.causal else None
    if diagonal is not None and diagonal >= e - a - 1:
        diagonal = None
    return slice(local + first, local + n), slice(a - k0, e - k0), diagonal


def forward_runs(kernel, q, key, value, runs, scale):
    """[(out, lse)] of one segment's runs against a block: the kernel's packed entry when
    it has one (one call for all of a segment's documents), else one call per run."""
    if hasattr(kernel, "forward_runs"):
        return kernel.forward_runs(q, key, value, runs, scale)
    return [kernel.forward(q[:, :, rows], key[:, :, ks], value[:, :, ks], diagonal, scale)
            for rows, ks, diagonal in runs]


def backward_runs(kernel, q, key, value, runs, scale, d_out, out, lse):
    """[(dq, dk, dv)] of one segment's runs, shaped like q[rows] and key/value[ks]."""
    if hasattr(kernel, "backward_runs"):
        return kernel.backward_runs(q, key, value, runs, scale, d_out, out, lse)
    return [kernel.backward(q[:, :, rows], key[:, :, ks], value[:, :, ks], diagonal, scale,
                            d_out[:, :, rows], out[:, :, rows], lse[:, :, rows])
            for rows, ks, diagonal in runs]


def rebuild(latent_block: torch.Tensor, kv_up_weight: torch.Tensor, plan: BlockPlan):
    """[B, b, d_c + d_r] -> K [b, h, B, d_n + d_r], V [b, h, B, d_v] (Megatron's math)."""
    kv_c, k_pe = torch.split(latent_block, [plan.kv_lora_rank, plan.rope_dim], dim=-1)
    key, value = rebuild_kv(kv_c, k_pe, kv_up_weight, plan.qk_head_dim, plan.v_head_dim)
    return key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)


def blockwise_forward(q, latent, kv_up_weight, plan: BlockPlan):
    """Attention over rebuilt key blocks, merged by log-sum-exp -> (out, lse float32)."""
    kernel = block_kernel(plan.kernel, plan.pad_v)
    b, h, s_q, _ = q.shape
    acc = acc_dtype(q.dtype)
    out = torch.zeros(b, h, s_q, plan.v_head_dim, dtype=acc, device=q.device)
    lse = torch.full((b, h, s_q), float("-inf"), dtype=acc, device=q.device)
    for k0, k1 in key_blocks(latent.shape[0], plan.block_size):
        key, value = rebuild(latent[k0:k1], kv_up_weight, plan)
        for runs in segment_runs(plan, k0, k1):
            for (rows, _, _), (block_out, block_lse) in zip(
                    runs, forward_runs(kernel, q, key, value, runs, plan.scale)):
                _merge(out, lse, rows, block_out, block_lse)
    return out.to(q.dtype), lse


def _merge(out, lse, rows, block_out, block_lse):
    """Online softmax: fold one block's (out, lse) of these rows into the running ones."""
    new_lse = torch.logaddexp(lse[:, :, rows], block_lse)
    out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - new_lse).unsqueeze(-1)
                       + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse[:, :, rows] = new_lse


def blockwise_backward(q, latent, kv_up_weight, out, lse, d_out, plan: BlockPlan):
    """Grads of q, the gathered latent and kv_up_weight, one rebuilt key block at a time."""
    kernel = block_kernel(plan.kernel, plan.pad_v)
    acc = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    d_latent = torch.zeros(latent.shape, dtype=acc, device=q.device)
    d_weight = torch.zeros(kv_up_weight.shape, dtype=acc, device=q.device)
    for k0, k1 in key_blocks(latent.shape[0], plan.block_size):
        key, value = rebuild(latent[k0:k1], kv_up_weight, plan)
        d_key = torch.zeros(key.shape, dtype=acc, device=q.device)
        d_value = torch.zeros(value.shape, dtype=acc, device=q.device)
        for runs in segment_runs(plan, k0, k1):
            grads = backward_runs(kernel, q, key, value, runs, plan.scale, d_out, out, lse)
            for (rows, ks, _), (dq_b, dk_b, dv_b) in zip(runs, grads):
                dq[:, :, rows] += dq_b
                d_key[:, :, ks] += dk_b
                d_value[:, :, ks] += dv_b
        _through_rebuild(latent[k0:k1], kv_up_weight, d_key, d_value, d_latent[k0:k1], d_weight, plan)
    return dq.to(q.dtype), d_latent.to(latent.dtype), d_weight.to(kv_up_weight.dtype)


def _through_rebuild(latent_block, kv_up_weight, d_key, d_value, d_latent_block, d_weight, plan):
    """Backward of :func:`rebuild`: dK, dV [b,h,B,.] -> latent block and weight grads."""
    d_nope, d_pe = torch.split(d_key, [plan.qk_head_dim, plan.rope_dim], dim=-1)
    d_kv = torch.cat([d_nope, d_value], dim=-1).permute(2, 0, 1, 3)  # [B, b, h, d_n + d_v]
    d_kv = d_kv.reshape(*d_kv.shape[:2], -1)
    kv_c = latent_block[..., :plan.kv_lora_rank].to(d_kv.dtype)
    d_latent_block[..., :plan.kv_lora_rank] = torch.matmul(d_kv, kv_up_weight.to(d_kv.dtype))
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

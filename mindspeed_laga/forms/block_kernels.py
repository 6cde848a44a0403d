"""Attention of query rows against one rebuilt key block, for the blockwise LAGA.

A block kernel has two calls (``keep`` [rows, B] bool, True = visible, or
None when every key is visible; every row sees at least one key):

- ``forward(q, key, value, keep, scale) -> (out float32, lse float32)``: the
  block's own softmax-normalized output and log-sum-exp, merged across blocks
  by the caller.
- ``backward(q, key, value, keep, scale, d_out, out, lse) -> (dq, dk, dv)``
  float32, where ``out``/``lse`` are the *final* (all-block) output and
  log-sum-exp, so the block's probabilities are exactly the global ones.
"""
from __future__ import annotations

import torch

from .fused_block import FusedBlock


def _scores(q, key, keep, scale):
    s = torch.matmul(q.float(), key.float().transpose(-1, -2)) * scale
    return s if keep is None else s.masked_fill(~keep, float("-inf"))


# Eager scores of one block are float32 [b, heads, rows, B]; heads are taken a few
# at a time so the transient scores/probabilities stay near this many elements.
SCORE_CHUNK_ELEMENTS = 1 << 25


def _head_chunks(q, key):
    b, h, rows, _ = q.shape
    per_head = max(1, b * rows * key.shape[2])
    step = max(1, min(h, SCORE_CHUNK_ELEMENTS // per_head))
    return [slice(i, i + step) for i in range(0, h, step)]


def _cat(parts):
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


class EagerBlock:
    """Plain torch math; one block's scores exist at a time, a few heads at a time."""

    @staticmethod
    def forward(q, key, value, keep, scale):
        outs, lses = [], []
        for heads in _head_chunks(q, key):
            s = _scores(q[:, heads], key[:, heads], keep, scale)
            lse = torch.logsumexp(s, dim=-1)
            outs.append(torch.matmul(torch.exp(s - lse.unsqueeze(-1)), value[:, heads].float()))
            lses.append(lse)
        return _cat(outs), _cat(lses)

    @staticmethod
    def backward(q, key, value, keep, scale, d_out, out, lse):
        grads = [EagerBlock._backward_heads(q[:, h], key[:, h], value[:, h], keep, scale,
                                            d_out[:, h], out[:, h], lse[:, h])
                 for h in _head_chunks(q, key)]
        return tuple(_cat(parts) for parts in zip(*grads))

    @staticmethod
    def _backward_heads(q, key, value, keep, scale, d_out, out, lse):
        p = torch.exp(_scores(q, key, keep, scale) - lse.unsqueeze(-1))
        do = d_out.float()
        delta = (do * out.float()).sum(dim=-1, keepdim=True)
        ds = p * (torch.matmul(do, value.float().transpose(-1, -2)) - delta)
        dq = torch.matmul(ds, key.float()) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
        return dq, dk, torch.matmul(p.transpose(-1, -2), do)


class NpuBlock:
    """``npu_fusion_attention`` forward and ``npu_fusion_attention_grad`` backward.

    The block mask is passed explicitly (``sparse_mode=0``, [rows, B] bool,
    True = masked): a block's diagonal offset is not one of the compressed
    modes. Backward hands the kernel the final log-sum-exp as softmax_max
    with softmax_sum = 1 and the final output as attention_in, as ring
    attention on Ascend does.
    """

    @staticmethod
    def forward(q, key, value, keep, scale):
        from ..kernels.npu import require_torch_npu
        torch_npu = require_torch_npu()
        res = torch_npu.npu_fusion_attention(q, key, value, q.shape[1], input_layout="BNSD",
                                             atten_mask=None if keep is None else ~keep,
                                             scale=scale, keep_prob=1.0, sparse_mode=0)
        out, row_max, row_sum = res[0], res[1][..., 0], res[2][..., 0]
        return out.float(), row_max.float() + torch.log(row_sum.float())

    @staticmethod
    def backward(q, key, value, keep, scale, d_out, out, lse):
        from ..kernels.npu import require_torch_npu
        torch_npu = require_torch_npu()
        stats = lse.unsqueeze(-1).expand(*lse.shape, 8).contiguous()
        dq, dk, dv = torch_npu.npu_fusion_attention_grad(
            q, key, value, d_out.to(q.dtype), q.shape[1], "BNSD",
            atten_mask=None if keep is None else ~keep, softmax_max=stats,
            softmax_sum=torch.ones_like(stats), attention_in=out.to(q.dtype), scale_value=scale,
            keep_prob=1.0, sparse_mode=0)[:3]
        return dq.float(), dk.float(), dv.float()


BLOCK_KERNELS = {"eager": EagerBlock, "npu": NpuBlock, "sdpa": FusedBlock}

"""Attention of query rows against one rebuilt key block, for the blockwise LAGA.

Interface every block kernel in ``BLOCK_KERNELS`` follows (the walk in
``laga_blockwise.py`` calls it once per (key block, run of query rows) pair; a
run is a query segment, cut at document boundaries when there are documents).
"float32" below is the accumulation dtype :func:`acc_dtype`: float32 for half
inputs, the input dtype (float32, float64) otherwise.

- Tensors are BNSD: ``q`` [b, h, rows, d_qk], ``key`` [b, h, B, d_qk],
  ``value`` [b, h, B, d_v] (``d_v`` may be below ``d_qk``, or equal to it when
  V was zero-padded); any float dtype; ``scale`` a float.
- ``diagonal`` describes visibility, never a dense mask: ``None`` = every key
  of the block is visible to every row; an ``int`` ``c`` = key ``j`` (0-based
  in the block handed over) is visible to row ``i`` (0-based in ``q``) iff
  ``j <= i + c``. The walk guarantees ``max(0, B - rows) <= c < B - 1``: every
  row sees key 0, the last row sees the last key, and ``None`` is used
  whenever all keys are visible. :func:`keep_mask` builds the [rows, B] bool
  mask from it for kernels that want one (its memory grows with the block,
  never with the sequence).
- ``forward(q, key, value, diagonal, scale) -> (out, lse)``: float32
  ``out`` [b, h, rows, d_v], the block's own softmax-normalized output, and
  float32 ``lse`` [b, h, rows], its log-sum-exp; the caller merges blocks.
- ``backward(q, key, value, diagonal, scale, d_out, out, lse) -> (dq, dk, dv)``
  float32, shaped like q/key/value; ``out``/``lse`` are the *final*
  (all-block) output and log-sum-exp of these rows, so the block's
  probabilities ``exp(s - lse)`` are exactly the global ones.
  ``d_out`` and ``out`` come in q's dtype, ``lse`` in float32.
- Kernels are stateless classes called as ``Kernel.forward(...)`` (static or
  class methods) and never see the sequence length. The walk picks one with
  :func:`block_kernel` (``BlockPlan.kernel`` and ``BlockPlan.pad_v``); a new
  kernel registers its class in ``BLOCK_KERNELS`` under its name.
"""
from __future__ import annotations

import torch

from ..kernels.precision import acc_dtype

from .fused_block import FusedBlock


def keep_mask(diagonal, rows: int, keys: int, device):
    """[rows, keys] bool, True = visible (key j for row i iff j <= i + diagonal); None = all."""
    if diagonal is None:
        return None
    return (torch.arange(keys, device=device).unsqueeze(0)
            <= torch.arange(rows, device=device).unsqueeze(1) + diagonal)


def _scores(q, key, keep, scale):
    acc = acc_dtype(q.dtype)
    s = torch.matmul(q.to(acc), key.to(acc).transpose(-1, -2)) * scale
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
    def forward(q, key, value, diagonal, scale):
        keep = keep_mask(diagonal, q.shape[2], key.shape[2], q.device)
        acc = acc_dtype(q.dtype)
        outs, lses = [], []
        for heads in _head_chunks(q, key):
            s = _scores(q[:, heads], key[:, heads], keep, scale)
            lse = torch.logsumexp(s, dim=-1)
            outs.append(torch.matmul(torch.exp(s - lse.unsqueeze(-1)), value[:, heads].to(acc)))
            lses.append(lse)
        return _cat(outs), _cat(lses)

    @staticmethod
    def backward(q, key, value, diagonal, scale, d_out, out, lse):
        keep = keep_mask(diagonal, q.shape[2], key.shape[2], q.device)
        grads = [EagerBlock._backward_heads(q[:, h], key[:, h], value[:, h], keep, scale,
                                            d_out[:, h], out[:, h], lse[:, h])
                 for h in _head_chunks(q, key)]
        return tuple(_cat(parts) for parts in zip(*grads))

    @staticmethod
    def _backward_heads(q, key, value, keep, scale, d_out, out, lse):
        acc = acc_dtype(q.dtype)
        p = torch.exp(_scores(q, key, keep, scale) - lse.unsqueeze(-1))
        do = d_out.to(acc)
        delta = (do * out.to(acc)).sum(dim=-1, keepdim=True)
        ds = p * (torch.matmul(do, value.to(acc).transpose(-1, -2)) - delta)
        dq = torch.matmul(ds, key.to(acc)) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
        return dq, dk, torch.matmul(p.transpose(-1, -2), do)


class NpuBlock:
    """``npu_fusion_attention`` forward and ``npu_fusion_attention_grad`` backward.

    No dense mask reaches the op: a fully visible block runs without a mask
    (mode 0), a block with a causal diagonal runs with the compressed
    2048x2048 mask in mode 3 or 4 (``kernels.npu.causal_kwargs``), whatever
    the block and sequence sizes are.

    Backward statistics: MindSpeed's ring attention
    (``mindspeed/core/context_parallel/ring_context_parallel``) merges the
    blocks' (softmax_max, softmax_sum) pairs in forward and hands each block's
    grad call the *merged* pair with the final output as attention_in. The
    kernel forms ``exp(s - softmax_max) / softmax_sum``; here the walk keeps
    only the final log-sum-exp, and ``softmax_max = lse``, ``softmax_sum = 1``
    gives exactly the same probabilities ``exp(s - lse)`` with half the saved
    statistics.
    """

    PAD_V = False  # zero-pad V to the q/k head dim for the op (``NpuBlockPadV``)

    @classmethod
    def forward(cls, q, key, value, diagonal, scale):
        from ..kernels.npu import pad_value, require_torch_npu
        torch_npu = require_torch_npu()
        d_v = value.shape[-1]
        if cls.PAD_V:
            value = pad_value(value, key.shape[-1])
        res = torch_npu.npu_fusion_attention(q, key, value, q.shape[1], input_layout="BNSD",
                                             scale=scale, keep_prob=1.0,
                                             **_mask_kwargs(q, key, diagonal))
        out, row_max, row_sum = res[0][..., :d_v], res[1][..., 0], res[2][..., 0]
        return out.float(), row_max.float() + torch.log(row_sum.float())

    @classmethod
    def backward(cls, q, key, value, diagonal, scale, d_out, out, lse):
        from ..kernels.npu import pad_value, require_torch_npu
        torch_npu = require_torch_npu()
        d_v = value.shape[-1]
        if cls.PAD_V:  # zero columns of V, dy and the output leave dq, dk and dv[:d_v] exact
            value, d_out, out = (pad_value(x, key.shape[-1]) for x in (value, d_out, out))
        stats = lse.unsqueeze(-1).expand(*lse.shape, 8).contiguous()
        dq, dk, dv = torch_npu.npu_fusion_attention_grad(
            q, key, value, d_out.to(q.dtype), q.shape[1], "BNSD", softmax_max=stats,
            softmax_sum=torch.ones_like(stats), attention_in=out.to(q.dtype), scale_value=scale,
            keep_prob=1.0, **_mask_kwargs(q, key, diagonal))[:3]
        return dq.float(), dk.float(), dv[..., :d_v].float()


class NpuBlockPadV(NpuBlock):
    """:class:`NpuBlock` with V zero-padded to the q/k head dim (``pad_v=True``)."""

    PAD_V = True


def _mask_kwargs(q, key, diagonal):
    if diagonal is None:
        return dict(sparse_mode=0)
    from ..kernels.npu import causal_kwargs
    return causal_kwargs(q.shape[2], key.shape[2], diagonal, q.device)


BLOCK_KERNELS = {"eager": EagerBlock, "npu": NpuBlock, "sdpa": FusedBlock}


def block_kernel(name: str, pad_v: bool = False):
    """The block kernel of ``BlockPlan.kernel``; ``pad_v`` matters to the NPU kernel only."""
    if name == "npu" and pad_v:
        return NpuBlockPadV
    return BLOCK_KERNELS[name]

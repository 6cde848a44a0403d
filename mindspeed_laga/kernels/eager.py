"""Eager attention: the score matrix is materialized (and kept for backward).

Scores and softmax run in float32 for half-precision inputs, as fused kernels
accumulate in float32; the probabilities are cast back before ``@ v``.
"""
from __future__ import annotations

import torch

from ..vocab.blocks import SCORE_CHUNK_ELEMENTS
from .base import BlockKernel
from .heads import expand_kv
from .masks import block_keep, segment_keep
from .precision import acc_dtype



def attend_segment(q, k, v, *, scale: float, causal: bool, pieces=None, keep=None):
    """``keep`` [b, 1, s_q, W] bool (key padding, ``masks.padded_keep_mask``): the
    visibility of every row, replacing ``causal`` and ``pieces``."""
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    compute = acc_dtype(q.dtype)
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-1, -2)) * scale
    keep = segment_keep(q.shape[2], k.shape[2], causal, pieces, q.device, keep)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


# ---- the block kernel of the blockwise walk (contract: kernels/block.py)

def _scores(q, key, keep, scale):
    acc = acc_dtype(q.dtype)
    s = torch.matmul(q.to(acc), key.to(acc).transpose(-1, -2)) * scale
    return s if keep is None else s.masked_fill(~keep, float("-inf"))


def _probs(s, lse, keep):
    """exp(s - lse); with key padding, exactly zero where masked (a row whose every key
    is masked has lse = -inf, and -inf - -inf would be NaN)."""
    p = torch.exp(s - lse.unsqueeze(-1))
    return p if keep is None else torch.where(keep, p, torch.zeros((), dtype=p.dtype))


def _head_chunks(q, key):
    b, h, rows, _ = q.shape
    per_head = max(1, b * rows * key.shape[2])
    step = max(1, min(h, SCORE_CHUNK_ELEMENTS // per_head))
    return [slice(i, i + step) for i in range(0, h, step)]


def _cat(parts):
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


class EagerBlock(BlockKernel):
    """Plain torch math; one block's scores exist at a time, a few heads at a time."""

    @staticmethod
    def forward(q, key, value, offset, scale, pad=None):
        keep = block_keep(q.shape[2], key.shape[2], offset, pad, q.device)
        acc = acc_dtype(q.dtype)
        outs, lses = [], []
        for heads in _head_chunks(q, key):
            s = _scores(q[:, heads], key[:, heads], keep, scale)
            lse = torch.logsumexp(s, dim=-1)
            probs = _probs(s, lse, keep if pad is not None else None)
            outs.append(torch.matmul(probs, value[:, heads].to(acc)))
            lses.append(lse)
        return _cat(outs), _cat(lses)

    @staticmethod
    def backward(q, key, value, offset, scale, d_out, out, lse, pad=None):
        keep = block_keep(q.shape[2], key.shape[2], offset, pad, q.device)
        grads = [EagerBlock._backward_heads(q[:, h], key[:, h], value[:, h], keep, scale,
                                            d_out[:, h], out[:, h], lse[:, h], pad is not None)
                 for h in _head_chunks(q, key)]
        return tuple(_cat(parts) for parts in zip(*grads))

    @staticmethod
    def _backward_heads(q, key, value, keep, scale, d_out, out, lse, padded=False):
        acc = acc_dtype(q.dtype)
        p = _probs(_scores(q, key, keep, scale), lse, keep if padded else None)
        do = d_out.to(acc)
        delta = (do * out.to(acc)).sum(dim=-1, keepdim=True)
        ds = p * (torch.matmul(do, value.to(acc).transpose(-1, -2)) - delta)
        dq = torch.matmul(ds, key.to(acc)) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
        return dq, dk, torch.matmul(p.transpose(-1, -2), do)

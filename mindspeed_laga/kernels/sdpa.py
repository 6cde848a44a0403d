"""PyTorch's fused attention: torch.nn.functional.scaled_dot_product_attention and,
where SDPA alone would fall back to its math path, the fused ops it wraps.

On CPU SDPA runs its flash kernel only for equal q/k and v head dims; MLA's
differ (d_qk = d_n + d_r > d_v), so SDPA would materialize and keep the score
matrix. CPU segments therefore call ``_scaled_dot_product_flash_attention_for_cpu``
(and its backward) directly through :class:`FusedSegment`: the narrower head
dim is zero-padded for the call only (exact: zero query/key columns add
nothing to the scores, zero value columns give zero output columns) and
sliced back, so autograd keeps q, K, V, the output and the log-sum-exp at
their own widths, no score matrix and no mask.

A causal segment whose queries end at the key prefix end is bottom-right
aligned, which SDPA's ``is_causal`` (top-left) is not. With ``o`` = keys -
queries, key ``j`` is visible to row ``i`` iff ``j <= i + o``: keys ``[0, o)``
are visible to every row and keys ``[o, S)`` follow a top-left causal mask,
so a segment is two fused calls merged by log-sum-exp (no dense mask; about
1.1x faster than the padded call with a mask, measured fwd+bwd on CPU).
Backward runs the same calls with the final output and log-sum-exp, which
makes each call's probabilities the global ones: dq adds up, dK/dV of the two
key ranges are concatenated. A small segment (at most ``MASKED_SCORES`` scores
per head) is one call with a cached additive mask instead: there the launches,
not the arithmetic, are what it costs (the merge alone is 11 ops), and one
call is what the accelerator kernels make per segment. By the same measure a small
causal call (every segment together at most ``MASKED_SCORES``) is one masked call for all
its segments (``attend_rows``). The blockwise LAGA's block kernel
(``kernels/block.py``, ``FusedBlock``) runs the same recipe per key block.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch
import torch.nn.functional as F

from ..double_backward import once_differentiable
from .base import BlockKernel
from .declared.eager import Eager
from .heads import expand_kv
from .masks import bottom_right, keep_mask, segment_keep
from .merge import merge_lse
from .nonfinite import visible_keys
from .precision import acc_dtype

_ATEN = torch.ops.aten


def block_calls(offset: Optional[int], num_keys: int):
    """(key slice, top-left causal) of the fused calls for keys visible iff
    ``j <= i + offset`` (``offset`` None = all visible, else >= 0)."""
    if offset is None or offset >= num_keys:
        return [(slice(0, num_keys), False)]
    if offset == 0:
        return [(slice(0, num_keys), True)]
    return [(slice(0, offset), False), (slice(offset, num_keys), True)]


# Scores per head up to which a bottom-right causal segment is one masked call, not two
# merged ones: at 8 x 32 one call takes half the time; at 256 x 1024 they are even
# (2% apart), at 512 x 2048 the masked call is 18% slower (forward, CPU, one thread).
MASKED_SCORES = 1 << 16


def small_segment_mask(rows: int, keys: int, offset: Optional[int], dtype, device):
    """The additive mask [rows, keys] (0 visible, -inf not) of a segment that runs as one
    masked call, or None: it needs no mask (every key, or top-left causal) or is large."""
    if offset is None or offset == 0 or offset >= keys or rows * keys > MASKED_SCORES:
        return None
    return _additive_mask(rows, keys, offset, dtype, device)


@lru_cache(maxsize=64)
def _additive_mask(rows: int, keys: int, offset: int, dtype, device) -> torch.Tensor:
    with torch.inference_mode(False):  # kept across calls, whatever mode made it
        return _additive(~keep_mask(rows, keys, offset, device), dtype)


def _additive(hidden: torch.Tensor, dtype) -> torch.Tensor:
    """A bool mask (True = hidden) as an additive one: 0 where visible, -inf where hidden."""
    mask = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
    return mask.masked_fill_(hidden, float("-inf"))


def _pad_last(x, width):
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _cpu_lse_dtype(dtype):
    """The CPU op keeps float64's log-sum-exp in float64 and any other's in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class CpuFlash:
    """``_scaled_dot_product_flash_attention_for_cpu`` (+ backward) on [b, h, s, d];
    any head dims (padded for the call), float64, float32, bfloat16, float16."""

    @staticmethod
    def forward(q, key, value, causal, scale, mask=None):
        out, lse = CpuFlash.forward_view(q, key, value, causal, scale, mask)
        # a copy, so what autograd keeps of the output is its own width, not the padded one
        return out.contiguous(), lse

    @staticmethod
    def forward_view(q, key, value, causal, scale, mask=None):
        """:meth:`forward`, its output a view of the op's padded one (for a merge, which
        reads it once and keeps none of it). ``mask``: additive, [s_q, s_k]."""
        d = max(q.shape[-1], value.shape[-1])
        out, lse = _ATEN._scaled_dot_product_flash_attention_for_cpu(
            _pad_last(q, d), _pad_last(key, d), _pad_last(value, d), 0.0, causal,
            attn_mask=mask, scale=scale)
        return (out if d == value.shape[-1] else out[..., :value.shape[-1]]), lse

    @staticmethod
    def backward(q, key, value, causal, scale, d_out, out, lse, mask=None):
        d = max(q.shape[-1], value.shape[-1])
        dq, dk, dv = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
            _pad_last(d_out, d), _pad_last(q, d), _pad_last(key, d), _pad_last(value, d),
            _pad_last(out, d), lse.to(_cpu_lse_dtype(q.dtype)), 0.0, causal, attn_mask=mask,
            scale=scale)
        return dq[..., :q.shape[-1]], dk[..., :key.shape[-1]], dv[..., :value.shape[-1]]


_LSE_ALIGN = 32  # the memory-efficient kernel pads its log-sum-exp rows to this


class CudaEfficient:
    """``_efficient_attention_forward`` / ``_backward`` (any d_qk, d_v; custom_mask_type
    1 = top-left causal) on [b, s, h, d] views of [b, h, s, d]."""

    @staticmethod
    def forward(q, key, value, causal, scale):
        bshd = [x.transpose(1, 2) for x in (q, key, value)]
        out, lse = _ATEN._efficient_attention_forward(
            *bshd, None, None, None, None, None, 0.0, int(causal), True, scale=scale)[:2]
        return out.transpose(1, 2), lse[..., :q.shape[2]]

    @staticmethod
    def backward(q, key, value, causal, scale, d_out, out, lse):
        rows = q.shape[2]
        lse_rows = lse.float().new_zeros(*lse.shape[:-1], -(-rows // _LSE_ALIGN) * _LSE_ALIGN)
        lse_rows[..., :rows] = lse
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        grads = _ATEN._efficient_attention_backward(
            d_out.transpose(1, 2), q.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
            None, out.transpose(1, 2), None, None, rows, key.shape[2], lse_rows, 0.0, seed, seed,
            int(causal), False, scale=scale)
        return tuple(g.transpose(1, 2) for g in grads[:3])


def fused_forward(ops, q, key, value, offset, scale):
    """-> (out, lse) in the op's dtypes, one or two fused calls merged by lse."""
    calls = block_calls(offset, key.shape[2])
    if len(calls) == 1:  # every key: no slices
        return ops.forward(q, key, value, calls[0][1], scale)
    forward = getattr(ops, "forward_view", ops.forward)  # the merge reads each output once
    parts = [forward(q, key[:, :, keys], value[:, :, keys], causal, scale)
             for keys, causal in calls]
    acc = acc_dtype(q.dtype)
    out, lse = merge_lse([(o.to(acc), l.to(acc)) for o, l in parts])
    return out, lse


def fused_backward(ops, q, key, value, offset, scale, d_out, out, lse):
    """-> (dq, dk, dv) from the final out and lse, in the op's dtype (dq of two calls
    summed in the accumulation dtype); no float32 copies of the op's grads."""
    dq, dks, dvs = None, [], []
    for keys, causal in block_calls(offset, key.shape[2]):
        g_q, g_k, g_v = ops.backward(q, key[:, :, keys], value[:, :, keys], causal, scale,
                                     d_out, out, lse)
        if dq is None:
            dq = g_q
        else:  # a second call: sum in the accumulation dtype
            dq = (dq if dq.dtype == acc_dtype(q.dtype) else dq.to(acc_dtype(q.dtype))).add_(g_q)
        dks.append(g_k)
        dvs.append(g_v)
    return dq, _cat_keys(dks), _cat_keys(dvs)


def _cat_keys(parts):
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


class FusedSegment(torch.autograd.Function):
    """One query segment on the CPU flash op; keeps q, K, V, output, lse."""

    @staticmethod
    def forward(ctx, q, key, value, scale, offset, mask=None):
        # mask: additive [s_q, S], every segment's rows at once (attend_rows); else the
        # segment's own small mask, or None (one or two fused calls by the offset)
        ctx.mask = mask if mask is not None else small_segment_mask(
            q.shape[2], key.shape[2], offset, q.dtype, q.device)
        if ctx.mask is not None:
            out, lse = CpuFlash.forward(q, key, value, False, scale, ctx.mask)
        else:
            out, lse = fused_forward(CpuFlash, q, key, value, offset, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, key, value, out, lse)
        ctx.scale, ctx.offset = scale, offset
        return out

    @staticmethod
    @once_differentiable("kernel='sdpa' (torch's fused CPU flash attention)",
                         "use kernel='eager' for second-order grads")
    def backward(ctx, d_out):
        q, key, value, out, lse = ctx.saved_tensors
        if ctx.mask is not None:
            dq, dk, dv = CpuFlash.backward(q, key, value, False, ctx.scale, d_out.to(q.dtype),
                                           out, lse, ctx.mask)
        else:
            dq, dk, dv = fused_backward(CpuFlash, q, key, value, ctx.offset, ctx.scale,
                                        d_out.to(q.dtype), out, lse)
        # K/V broadcast to all heads (absorbed form) come in expanded: autograd sums their grads
        return dq.to(q.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None


def attend_rows(q, k, v, *, scale: float, windows):
    """Every causal segment of a call (``windows``, rows in order, each bottom-right aligned
    in its key window) in one masked CPU call, when all of them hold at most
    ``MASKED_SCORES`` scores per head; else None (a call per segment). Below that size the
    launches, not the arithmetic, are what a call costs: one call with a cached mask does
    the work of the segments' calls, merges and concatenation."""
    rows = sum(w.rows for w in windows)
    if (q.device.type != "cpu" or len(windows) < 2 or rows != q.shape[2]
            or rows * k.shape[2] > MASKED_SCORES):
        return None
    mask = _windows_mask(tuple(windows), k.shape[2], q.dtype, q.device)
    return FusedSegment.apply(q, expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1]), scale,
                              None, mask)


@lru_cache(maxsize=64)
def _windows_mask(windows, keys: int, dtype, device) -> torch.Tensor:
    """The additive mask [rows, keys] of ``windows``: each row sees the keys the non-finite
    guard counts for it (``nonfinite.visible_keys``: its window, bottom-right causal)."""
    with torch.inference_mode(False):  # kept across calls, whatever mode made it
        start, end = visible_keys(windows, True, device)
        key = torch.arange(keys, device=device)
        return _additive((key < start[:, None]) | (key >= end[:, None]), dtype)


def attend_segment(q, k, v, *, scale: float, causal: bool, pieces=None, keep=None):
    """``keep`` [b, 1, s_q, W] bool (key padding): SDPA with that mask."""
    plain = keep is None and pieces is None  # no padding, no documents: causal or nothing
    if q.device.type == "cpu" and plain:
        # keys - queries: the bottom-right causal diagonal of a segment ending at the prefix end
        offset = bottom_right(q.shape[2], k.shape[2]) if causal else None
        return FusedSegment.apply(q, expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1]), scale,
                                  offset)
    # Padding, documents (a block-diagonal mask per segment) and other devices: SDPA with a
    # mask, except a square causal segment: SDPA's is_causal is top-left aligned, which is
    # bottom-right there (a segment ending at the prefix end needs the bottom-right mask).
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    square_causal = plain and causal and q.shape[2] == k.shape[2]
    mask = None if square_causal else segment_keep(q.shape[2], k.shape[2], causal, pieces, q.device, keep)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=square_causal, scale=scale)


# ---- the block kernel of the blockwise walk (contract: kernels/block.py)

# Which op pair runs a block, by device type (scripts/dev/cuda_block_kernels.py swaps the
# CUDA entry to compare candidates).
BACKENDS = {"cpu": CpuFlash, "cuda": CudaEfficient}


def backend_for(device: torch.device):
    if device.type not in BACKENDS:
        raise ValueError(f"kernel='sdpa' with recompute_kv has fused block ops for "
                         f"{sorted(BACKENDS)} tensors, not {device.type!r}; use kernel='eager' "
                         "(or 'npu' on Ascend)")
    return BACKENDS[device.type]


class FusedBlock(BlockKernel):
    """Block kernel on fused attention ops (CPU flash, CUDA memory-efficient): no score
    matrix, one or two calls a block.

    After the block walk has cut rows that see nothing, a causal block's
    visibility is a causal offset ``o >= 0``: key ``j`` is
    visible to row ``i`` iff ``j <= i + o``. Keys ``[0, o)`` are then visible to
    every row and keys ``[o, B)`` follow a top-left causal mask relative to the
    rows: one fused call (no mask, or top-left causal when ``o == 0``) or two
    merged by log-sum-exp, no dense mask (``kernels/sdpa.py`` has the recipe and
    the ops). Backward runs the same calls with the *final* output and
    log-sum-exp, which makes each call's probabilities the global ones.

    - CPU: ``_scaled_dot_product_flash_attention_for_cpu`` and its backward
      (float64, float32, bfloat16; the narrower head dim zero-padded for the call).
    - CUDA: ``_efficient_attention_forward`` / ``_efficient_attention_backward``
      (any d_qk, d_v). Why this one and not flash or cuDNN: docs/BEYOND.md.
    """

    @staticmethod
    def forward(q, key, value, offset, scale, pad=None):
        if pad is not None:  # the fused ops take no per-sample mask: one block's eager math
            return Eager().block.forward(q, key, value, offset, scale, pad)
        out, lse = fused_forward(backend_for(q.device), q, key, value, offset, scale)
        acc = acc_dtype(q.dtype)
        return out.to(acc), lse.to(acc)

    @staticmethod
    def backward(q, key, value, offset, scale, d_out, out, lse, pad=None):
        if pad is not None:
            return Eager().block.backward(q, key, value, offset, scale, d_out, out, lse, pad)
        return fused_backward(backend_for(q.device), q, key, value, offset, scale,
                              d_out.to(q.dtype), out.to(q.dtype), lse)


def fused_block_ops(device: torch.device, dtype) -> bool:
    """Whether :class:`FusedBlock` has fused ops for these tensors (CUDA's memory-
    efficient kernel has no float64)."""
    return device.type == "cpu" or (device.type == "cuda" and dtype != torch.float64)

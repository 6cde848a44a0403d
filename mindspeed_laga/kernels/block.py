"""Attention of query rows against one rebuilt key block, for the blockwise LAGA.

Interface every block kernel in ``BLOCK_KERNELS`` follows (the walk in
``forms/laga_blockwise.py`` calls it once per (key block, run of query rows) pair; a
run is a query segment, cut at document boundaries when there are documents).
"float32" below is the accumulation dtype :func:`acc_dtype`: float32 for half
inputs, the input dtype (float32, float64) otherwise.

- Tensors are BNSD: ``q`` [b, h, rows, d_qk], ``key`` [b, h, B, d_qk],
  ``value`` [b, h, B, d_v] (``d_v`` may be below ``d_qk``, or equal to it when
  V was zero-padded); any float dtype; ``scale`` a float.
- ``offset``, the causal offset (``kernels/masks.py``), describes visibility,
  never a dense mask: ``None`` = every key of the block is visible to every
  row; an ``int`` ``c`` = key ``j`` (0-based in the block handed over) is
  visible to row ``i`` (0-based in ``q``) iff ``j <= i + c``. The walk
  guarantees ``max(0, B - rows) <= c < B - 1``: every row sees key 0, the
  last row sees the last key, and ``None`` is used whenever all keys are
  visible. ``masks.keep_mask`` builds the [rows, B] bool mask from it for
  kernels that want one (its memory grows with the block, never with the
  sequence).
- ``forward(q, key, value, offset, scale) -> (out, lse)``: float32
  ``out`` [b, h, rows, d_v], the block's own softmax-normalized output, and
  float32 ``lse`` [b, h, rows], its log-sum-exp; the caller merges blocks.
- ``backward(q, key, value, offset, scale, d_out, out, lse) -> (dq, dk, dv)``
  shaped like q/key/value, float32 or q's dtype (what the op gives: the walk
  adds dq into its float32 accumulator and pushes dK/dV through the rebuild in
  their own dtype, so a kernel makes no float32 copies of its grads);
  ``out``/``lse`` are the *final*
  (all-block) output and log-sum-exp of these rows, so the block's
  probabilities ``exp(s - lse)`` are exactly the global ones.
  ``d_out`` and ``out`` come in q's dtype, ``lse`` in float32.
- Packed entry (optional): the walk groups the runs per (key block, query
  segment); a kernel with ``forward_runs(q, key, value, runs, scale)`` and
  ``backward_runs(q, key, value, runs, scale, d_out, out, lse)`` gets all of
  one segment's runs against the block in one call, with ``q``/``d_out``/
  ``out``/``lse`` the *whole* local tensors, ``key``/``value`` the whole
  block, and ``runs`` the walk's ``[(rows, key slice, offset)]`` (disjoint
  rows in order, one run per document the segment crosses in the block).
  They return one ``(out, lse)`` / ``(dq, dk, dv)`` per run, shaped and typed
  as ``forward``/``backward`` would for ``q[:, :, rows]``, ``key[:, :, ks]``,
  so the walk merges and accumulates them the same way. Kernels without it
  (eager, fused) get one ``forward``/``backward`` call per run.
- Key padding (optional keyword ``pad`` of ``forward``/``backward``, [b, keys] bool,
  True = padding key of the slice handed over): those keys are invisible too. A row
  may then see no key of the block: its ``out`` is zero and its ``lse`` ``-inf``
  (the merge skips it), and its grads are zero; a row that sees no key at all has a
  final ``lse`` of ``-inf``. The walk never uses the packed entry with padding.
- Kernels are stateless classes called as ``Kernel.forward(...)`` (static or
  class methods) and never see the sequence length. The walk picks one with
  :func:`block_kernel` (``BlockPlan.kernel`` and ``BlockPlan.pad_v``); a new
  kernel registers its class in ``BLOCK_KERNELS`` under its name.
"""
from __future__ import annotations

import torch

from .masks import keep_mask
from .npu import causal_kwargs, pad_value, require_torch_npu, varlen_kwargs
from .precision import acc_dtype
from .sdpa import CpuFlash, CudaEfficient, fused_backward, fused_forward


def _scores(q, key, keep, scale):
    acc = acc_dtype(q.dtype)
    s = torch.matmul(q.to(acc), key.to(acc).transpose(-1, -2)) * scale
    return s if keep is None else s.masked_fill(~keep, float("-inf"))


def block_keep(rows: int, keys: int, offset, pad, device):
    """The visibility a block kernel applies: the causal offset's [rows, keys] mask, and
    with key padding ([b, keys]) that mask minus the padding keys, [b, 1, rows, keys]."""
    keep = keep_mask(rows, keys, offset, device)
    if pad is None:
        return keep
    return (~pad[:, None, None, :]) if keep is None else keep & ~pad[:, None, None, :]


def _probs(s, lse, keep):
    """exp(s - lse); with a mask, exactly zero where masked (a row whose every key is
    masked has lse = -inf, and -inf - -inf would be NaN)."""
    p = torch.exp(s - lse.unsqueeze(-1))
    return p if keep is None else torch.where(keep, p, torch.zeros((), dtype=p.dtype))


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
    def forward(q, key, value, offset, scale, pad=None):
        keep = block_keep(q.shape[2], key.shape[2], offset, pad, q.device)
        acc = acc_dtype(q.dtype)
        outs, lses = [], []
        for heads in _head_chunks(q, key):
            s = _scores(q[:, heads], key[:, heads], keep, scale)
            lse = torch.logsumexp(s, dim=-1)
            probs = torch.exp(s - lse.unsqueeze(-1)) if pad is None else _probs(s, lse, keep)
            outs.append(torch.matmul(probs, value[:, heads].to(acc)))
            lses.append(lse)
        return _cat(outs), _cat(lses)

    @staticmethod
    def backward(q, key, value, offset, scale, d_out, out, lse, pad=None):
        keep = block_keep(q.shape[2], key.shape[2], offset, pad, q.device)
        grads = [EagerBlock._backward_heads(q[:, h], key[:, h], value[:, h], keep, scale,
                                            d_out[:, h], out[:, h], lse[:, h])
                 for h in _head_chunks(q, key)]
        return tuple(_cat(parts) for parts in zip(*grads))

    @staticmethod
    def _backward_heads(q, key, value, keep, scale, d_out, out, lse):
        acc = acc_dtype(q.dtype)
        p = _probs(_scores(q, key, keep, scale), lse, keep if keep is not None and keep.dim() == 4
                   else None)
        do = d_out.to(acc)
        delta = (do * out.to(acc)).sum(dim=-1, keepdim=True)
        ds = p * (torch.matmul(do, value.to(acc).transpose(-1, -2)) - delta)
        dq = torch.matmul(ds, key.to(acc)) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
        return dq, dk, torch.matmul(p.transpose(-1, -2), do)


class NpuBlock:
    """``npu_fusion_attention`` forward and ``npu_fusion_attention_grad`` backward.

    No dense mask reaches the op: a fully visible block runs without a mask
    (mode 0), a block with a causal offset runs with the compressed
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

    Packed documents: ``forward_runs``/``backward_runs`` split each run into
    its bottom-right-aligned causal part and its fully visible part (rows past
    the offset see the whole key slice) and pack the parts of all runs as
    varlen sequences (layout TND): at most two calls per (block, segment),
    mode 3 with the compressed mask for the causal parts and mode 0 without a
    mask for the full ones, whatever the number of documents.
    """

    PAD_V = False  # zero-pad V to the q/k head dim for the op (``NpuBlockPadV``)

    @classmethod
    def forward(cls, q, key, value, offset, scale, pad=None):
        torch_npu = require_torch_npu()
        d_v = value.shape[-1]
        if cls.PAD_V:
            value = pad_value(value, key.shape[-1])
        res = torch_npu.npu_fusion_attention(q, key, value, q.shape[1], input_layout="BNSD",
                                             scale=scale, keep_prob=1.0,
                                             **_mask_kwargs(q, key, offset, pad))
        out, row_max, row_sum = res[0][..., :d_v], res[1][..., 0], res[2][..., 0]
        return out.float(), row_max.float() + torch.log(row_sum.float())

    @classmethod
    def backward(cls, q, key, value, offset, scale, d_out, out, lse, pad=None):
        torch_npu = require_torch_npu()
        d_v = value.shape[-1]
        if cls.PAD_V:  # zero columns of V, dy and the output leave dq, dk and dv[:d_v] exact
            value, d_out, out = (pad_value(x, key.shape[-1]) for x in (value, d_out, out))
        if pad is not None:  # a row that sees no key anywhere (lse -inf): any finite statistic
            lse = torch.where(torch.isinf(lse), torch.zeros((), dtype=lse.dtype), lse)
        stats = lse.unsqueeze(-1).expand(*lse.shape, 8).contiguous()
        dq, dk, dv = torch_npu.npu_fusion_attention_grad(
            q, key, value, d_out.to(q.dtype), q.shape[1], "BNSD", softmax_max=stats,
            softmax_sum=torch.ones_like(stats), attention_in=out.to(q.dtype), scale_value=scale,
            keep_prob=1.0, **_mask_kwargs(q, key, offset, pad))[:3]
        return dq, dk, dv[..., :d_v]


    # ---- packed: all runs of one query segment against one block in at most two TND calls

    @classmethod
    def forward_runs(cls, q, key, value, runs, scale):
        if len(runs) == 1 or q.shape[0] != 1:  # one document here: the single call above
            return [cls.forward(q[:, :, r], key[:, :, ks], value[:, :, ks], c, scale)
                    for r, ks, c in runs]
        torch_npu = require_torch_npu()
        d_v = value.shape[-1]
        if cls.PAD_V:
            value = pad_value(value, key.shape[-1])
        outs = [[] for _ in runs]  # per run: (first row, out, lse) of its parts
        for causal, pieces in _packed_parts(runs).items():
            res = torch_npu.npu_fusion_attention(
                _rows_tnd(q, pieces), _keys_tnd(key, pieces), _keys_tnd(value, pieces), q.shape[1],
                scale=scale, **_varlen_kwargs(pieces, causal, q.device))
            lse = res[1][..., 0].float() + torch.log(res[2][..., 0].float())  # [T, N]
            for i, rows, _, t_q, _ in _offsets(pieces):
                n = rows.stop - rows.start
                outs[i].append((rows.start, _bnsd(res[0][t_q:t_q + n, :, :d_v].float()),
                                lse[t_q:t_q + n].transpose(0, 1).unsqueeze(0)))
        return [tuple(torch.cat([p[j] for p in sorted(parts, key=lambda p: p[0])], dim=2)
                      for j in (1, 2)) for parts in outs]

    @classmethod
    def backward_runs(cls, q, key, value, runs, scale, d_out, out, lse):
        if len(runs) == 1 or q.shape[0] != 1:
            return [cls.backward(q[:, :, r], key[:, :, ks], value[:, :, ks], c, scale,
                                 d_out[:, :, r], out[:, :, r], lse[:, :, r]) for r, ks, c in runs]
        torch_npu = require_torch_npu()
        d_v = value.shape[-1]
        if cls.PAD_V:
            value, d_out, out = (pad_value(x, key.shape[-1]) for x in (value, d_out, out))
        grads = {i: [torch.zeros(q[:, :, r].shape, dtype=torch.float32, device=q.device),
                     torch.zeros(key[:, :, ks].shape, dtype=torch.float32, device=q.device),
                     torch.zeros(key[:, :, ks].shape[:-1] + (d_v,), dtype=torch.float32,
                                 device=q.device)]
                 for i, (r, ks, _) in enumerate(runs)}
        for causal, pieces in _packed_parts(runs).items():
            stats = _rows_tnd(lse.float().unsqueeze(-1), pieces).expand(-1, -1, 8).contiguous()
            dq, dk, dv = torch_npu.npu_fusion_attention_grad(
                _rows_tnd(q, pieces), _keys_tnd(key, pieces), _keys_tnd(value, pieces),
                _rows_tnd(d_out.to(q.dtype), pieces), q.shape[1], softmax_max=stats,
                softmax_sum=torch.ones_like(stats), attention_in=_rows_tnd(out.to(q.dtype), pieces),
                scale_value=scale, **_varlen_kwargs(pieces, causal, q.device))[:3]
            for i, rows, keys, t_q, t_k in _offsets(pieces):
                n_q, n_k = rows.stop - rows.start, keys.stop - keys.start
                r0, k0 = rows.start - runs[i][0].start, keys.start - runs[i][1].start
                g = grads[i]
                g[0][:, :, r0:r0 + n_q] += _bnsd(dq[t_q:t_q + n_q].float())
                g[1][:, :, k0:k0 + n_k] += _bnsd(dk[t_k:t_k + n_k].float())
                g[2][:, :, k0:k0 + n_k] += _bnsd(dv[t_k:t_k + n_k, :, :d_v].float())
        return [tuple(grads[i]) for i in range(len(runs))]


def _packed_parts(runs):
    """Each run split into its causal part and its fully visible part, packed per kind.

    With offset c (key j visible to row i iff j <= i + c) over B keys, rows
    ``i >= B - 1 - c`` see the whole key slice; rows ``i < m = B - 1 - c`` see
    keys ``[0, m + c)`` bottom-right aligned (row m-1 sees key m+c-1). The walk's
    ``c < B - 1`` makes m >= 1, and its last row seeing the last key leaves the
    full part non-empty. Returns {causal: [(run index, absolute rows, absolute
    keys)]}, the rows and keys of each part as slices of q and of the block.
    """
    packed = {True: [], False: []}
    for i, (rows, ks, c) in enumerate(runs):
        n, b = rows.stop - rows.start, ks.stop - ks.start
        m = 0 if c is None else min(n, b - 1 - c)
        if m:
            packed[True].append((i, slice(rows.start, rows.start + m), slice(ks.start, ks.start + m + c)))
        if m < n:
            packed[False].append((i, slice(rows.start + m, rows.stop), ks))
    return {causal: pieces for causal, pieces in packed.items() if pieces}


def _offsets(pieces):
    """(run index, rows, keys, first packed row, first packed key) of each piece."""
    t_q = t_k = 0
    for i, rows, keys in pieces:
        yield i, rows, keys, t_q, t_k
        t_q, t_k = t_q + rows.stop - rows.start, t_k + keys.stop - keys.start


def _bnsd(x):
    """[T, h, d] -> [1, h, T, d]."""
    return x.transpose(0, 1).unsqueeze(0)


def _rows_tnd(x, pieces):
    """[1, h, rows, d] -> the pieces' rows packed as [T, h, d]."""
    return torch.cat([x[0, :, rows] for _, rows, _ in pieces], dim=1).transpose(0, 1).contiguous()


def _keys_tnd(x, pieces):
    """[1, h, B, d] -> the pieces' key slices packed as [T_kv, h, d]."""
    return torch.cat([x[0, :, keys] for _, _, keys in pieces], dim=1).transpose(0, 1).contiguous()


def _varlen_kwargs(pieces, causal, device):
    return varlen_kwargs([r.stop - r.start for _, r, _ in pieces],
                         [k.stop - k.start for _, _, k in pieces], causal, device)


class NpuBlockPadV(NpuBlock):
    """:class:`NpuBlock` with V zero-padded to the q/k head dim (``pad_v=True``)."""

    PAD_V = True


def _mask_kwargs(q, key, offset, pad=None):
    if pad is not None:
        # key padding: the op's dense mask (B1SS, True = masked) in mode 0. A row may see
        # no key of this block: inner_precise=2 is the op's documented switch for such
        # "invalid rows" (zero output, lse -inf, zero grads; unspecified without it)
        keep = block_keep(q.shape[2], key.shape[2], offset, pad, q.device)
        keep = keep.expand(pad.shape[0], 1, q.shape[2], key.shape[2])  # B1SS, as the op takes it
        return dict(sparse_mode=0, atten_mask=~keep, inner_precise=2)
    if offset is None:
        return dict(sparse_mode=0)
    return causal_kwargs(q.shape[2], key.shape[2], offset, q.device)


# Which op pair runs a block, by device type (scripts/dev/cuda_block_kernels.py swaps the
# CUDA entry to compare candidates).
BACKENDS = {"cpu": CpuFlash, "cuda": CudaEfficient}


def backend_for(device: torch.device):
    if device.type not in BACKENDS:
        raise ValueError(f"kernel='sdpa' with recompute_kv has fused block ops for "
                         f"{sorted(BACKENDS)} tensors, not {device.type!r}; use kernel='eager' "
                         "(or 'npu' on Ascend)")
    return BACKENDS[device.type]


class FusedBlock:
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
            return EagerBlock.forward(q, key, value, offset, scale, pad)
        out, lse = fused_forward(backend_for(q.device), q, key, value, offset, scale)
        acc = acc_dtype(q.dtype)
        return out.to(acc), lse.to(acc)

    @staticmethod
    def backward(q, key, value, offset, scale, d_out, out, lse, pad=None):
        if pad is not None:
            return EagerBlock.backward(q, key, value, offset, scale, d_out, out, lse, pad)
        return fused_backward(backend_for(q.device), q, key, value, offset, scale,
                              d_out.to(q.dtype), out.to(q.dtype), lse)


BLOCK_KERNELS = {"eager": EagerBlock, "npu": NpuBlock, "sdpa": FusedBlock}


def block_kernel(name: str, pad_v: bool = False):
    """The block kernel of ``BlockPlan.kernel``; ``pad_v`` matters to the NPU kernel only."""
    if name == "npu" and pad_v:
        return NpuBlockPadV
    return BLOCK_KERNELS[name]

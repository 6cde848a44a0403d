"""Ascend ``torch_npu.npu_fusion_attention``.

The recipe of docs/DESIGN.md, section 'Kernels': keys are sliced to the segment's causal
prefix and the call uses ``sparse_mode=3`` (right-down causal) with the
compressed 2048x2048 ``triu(diagonal=1)`` bool mask (True = masked). Layout
BNSD; ``n_k`` may divide ``n`` (grouped heads).

With documents the segment's pieces are the sequences of one varlen call
(layout TND, cumulative ``actual_seq_qlen``/``actual_seq_kvlen`` host lists):
``sparse_mode=3`` applies the compressed mask causally from each sequence's
lower-right vertex, mode 0 without a mask lets each sequence see all of its
keys. One call per segment whatever the number of documents, never a mask of
the segment.

What the calls rely on, from the public ``torch_npu.npu_fusion_attention``
reference (Ascend/op-plugin ``docs/context/torch_npu-npu_fusion_attention.md``):

- modes 2/3/4 take the compressed 2048x2048 lower-triangle mask whatever
  Sq/Skv are, so no mask here ever grows with the sequence; mode 3 ignores
  pre/next tokens and aligns the diagonal at the lower-right vertex; mode 4
  keeps the band ``[pre_tockens, next_tockens]`` counted from the lower-right
  vertex (row i sees keys ``i + Skv - Sq - pre .. i + Skv - Sq + next``), and
  a negative ``next_tockens`` needs ``pre_tockens >= |next_tockens|`` and
  ``|next_tockens| < Skv``;
- head dims ``Dq == Dk >= Dv`` (1..768), ``Nq`` 1..256 and a multiple of
  ``Nkv``.

V padding. Unpadded V (``Dv < Dk``: MLA's 192/128, the absorbed 576/512) is
within the documented rule, but the MindSpeed-LLM documentation of
``--mla-fa-without-pad`` (Ascend/MindSpeed-LLM
``docs/en/pytorch/features/mcore/multi-latent-attention.md``) recommends
CANN 8.2.RC1 or later for it and names a shape-mismatch error in the fused
attention on older packages. ``pad_v=True`` therefore zero-pads V to the q/k
head dim before the call and slices the output back, as MindSpeed-LLM does
without that flag: exact, since the padded columns of the output are zero and
their gradient is dropped by the slice.
"""
from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from .base import BlockKernel
from .masks import block_keep

COMPRESSED_MASK_SIZE = 2048
_MASK_CACHE = {}


def require_torch_npu():
    """Import torch_npu or raise the error that names the fix."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        raise ValueError(
            "kernel='npu' needs torch_npu (Ascend CANN + torch_npu matching your torch; "
            "pip install mindspeed-laga[npu]); on CPU/GPU use kernel='sdpa' or 'eager'"
        ) from exc


def compressed_causal_mask(device) -> torch.Tensor:
    """The 2048x2048 mask sparse_mode 2/3/4 expect: True above the diagonal."""
    key = str(device)
    if key not in _MASK_CACHE:
        size = COMPRESSED_MASK_SIZE
        _MASK_CACHE[key] = torch.ones(size, size, dtype=torch.bool, device=device).triu(diagonal=1)
    return _MASK_CACHE[key]


def causal_kwargs(rows: int, keys: int, offset: int, device) -> dict:
    """Mask arguments for: key j visible to row i iff ``j <= i + offset`` (0 <= offset).

    The offset through the lower-right corner (``offset == keys - rows``)
    is mode 3; any other is mode 4's band with ``next_tockens`` the offset from
    that corner and ``pre_tockens = keys``, which reaches below key 0 for
    every row (``i + keys - rows - keys < 0``) and is at least
    ``|next_tockens|`` (``next_tockens >= rows - keys > -keys``).
    """
    if offset < 0:
        raise ValueError(f"offset={offset}: row 0 would see no key")
    kwargs = dict(atten_mask=compressed_causal_mask(device))
    shift = keys - rows
    if offset == shift:
        return dict(kwargs, sparse_mode=3)
    return dict(kwargs, sparse_mode=4, pre_tockens=keys, next_tockens=offset - shift)


def pad_value(value: torch.Tensor, head_dim: int) -> torch.Tensor:
    """V [.., d_v] zero-padded to ``head_dim`` (unchanged when already that wide)."""
    extra = head_dim - value.shape[-1]
    return value if extra <= 0 else F.pad(value, (0, extra))


def attend_segment(q, k, v, *, scale: float, causal: bool, pad_v: bool = False, pieces=None,
                   keep=None):
    """One ``npu_fusion_attention`` call for the segment; with ``pieces`` (documents)
    the pieces are packed as varlen sequences (:func:`attend_pieces`).

    ``keep`` [b, 1, s_q, W] bool (key padding): the op's own dense mask, ``atten_mask``
    = ``~keep`` (B1SS, True = masked) in ``sparse_mode=0``, as MindSpeed-LLM passes the
    SFT mask. No row of it is fully masked (``masks.padded_keep_mask``)."""
    torch_npu = require_torch_npu()
    d_v = v.shape[-1]
    if pad_v:
        v = pad_value(v, k.shape[-1])
    if keep is not None:
        out = torch_npu.npu_fusion_attention(q, k, v, q.shape[1], input_layout="BNSD",
                                             scale=scale, keep_prob=1.0, atten_mask=~keep,
                                             sparse_mode=0)[0]
    elif pieces is not None:
        out = attend_pieces(torch_npu, q, k, v, scale=scale, causal=causal, pieces=pieces)
    else:
        kwargs = dict(input_layout="BNSD", scale=scale, keep_prob=1.0)
        if causal:
            kwargs.update(causal_kwargs(q.shape[2], k.shape[2], k.shape[2] - q.shape[2], q.device))
        out = torch_npu.npu_fusion_attention(q, k, v, q.shape[1], **kwargs)[0]
    return out[..., :d_v] if out.shape[-1] != d_v else out


def to_tnd(x: torch.Tensor) -> torch.Tensor:
    """[1, n, S, d] -> [S, n, d] (TND has no batch axis: documents come one micro-batch at a time)."""
    if x.shape[0] != 1:
        raise ValueError(f"cu_seqlens (packed documents) needs micro-batch size 1 for kernel='npu'; "
                         f"got batch {x.shape[0]}: pack the micro-batch into one sequence")
    return x[0].transpose(0, 1).contiguous()


def varlen_kwargs(q_lengths, kv_lengths, causal: bool, device) -> dict:
    """TND arguments for sequences of these query/key lengths: cumulative host lists,
    mode 3 (causal from each sequence's lower-right vertex, compressed mask) or
    mode 0 without mask (each sequence sees all of its keys)."""
    kwargs = dict(input_layout="TND", actual_seq_qlen=_cumsum(q_lengths),
                  actual_seq_kvlen=_cumsum(kv_lengths), keep_prob=1.0)
    if causal:
        return dict(kwargs, sparse_mode=3, atten_mask=compressed_causal_mask(device))
    return dict(kwargs, sparse_mode=0)


def _cumsum(lengths):
    out, total = [], 0
    for n in lengths:
        total += int(n)
        out.append(total)
    return out


def attend_pieces(torch_npu, q, k, v, *, scale: float, causal: bool, pieces):
    """The segment's document pieces as one TND call.

    Pieces cover the segment's rows in order and their key ranges follow each
    other through the key window (a piece's keys end where the next document
    starts), so q and k/v are the varlen packing as they are: no copy, no mask
    beyond the compressed one, one call whatever the number of documents.
    """
    q_end = k_end = 0
    for q0, n, k0, k1 in pieces:
        if q0 != q_end or k0 != k_end:
            raise ValueError(f"document pieces {list(pieces)} do not tile the segment's rows "
                             "and key window in order")
        q_end, k_end = q0 + n, k1
    if q_end != q.shape[2] or k_end != k.shape[2]:
        raise ValueError(f"document pieces {list(pieces)} cover {q_end} rows and {k_end} keys; "
                         f"the segment has {q.shape[2]} rows and {k.shape[2]} keys")
    kwargs = varlen_kwargs([p.length for p in pieces], [p.k_end - p.k_start for p in pieces],
                           causal, q.device)
    out = torch_npu.npu_fusion_attention(to_tnd(q), to_tnd(k), to_tnd(v), q.shape[1],
                                         scale=scale, **kwargs)[0]
    return out.transpose(0, 1).unsqueeze(0)


# ---- the block kernel of the blockwise walk (contract: kernels/block.py)

class NpuBlock(BlockKernel):
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

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
    kwargs = varlen_kwargs([p[1] for p in pieces], [p[3] - p[2] for p in pieces], causal, q.device)
    out = torch_npu.npu_fusion_attention(to_tnd(q), to_tnd(k), to_tnd(v), q.shape[1],
                                         scale=scale, **kwargs)[0]
    return out.transpose(0, 1).unsqueeze(0)

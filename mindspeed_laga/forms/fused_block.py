"""Block kernel on PyTorch's fused attention ops (CPU flash, CUDA memory-efficient).

The blockwise LAGA hands a block kernel query rows and one rebuilt key block
(see ``block_kernels``). After the block walk has cut rows that see nothing,
a causal block's visibility is a diagonal offset ``o >= 0``: key ``j`` is
visible to row ``i`` iff ``j <= i + o``. So keys ``[0, o)`` are visible to
every row and keys ``[o, B)`` follow a top-left causal mask relative to the
rows. Both are shapes the fused ops take without a dense mask: a block is one
fused call (no mask, or top-left causal when ``o == 0``) or two merged by
log-sum-exp. Backward runs the same calls with the *final* output and
log-sum-exp, which makes each call's probabilities the global ones, so dq
adds up and dK/dV of the two key ranges are concatenated.

Ops (``torch.ops.aten``), both returning the log-sum-exp:

- CPU: ``_scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``
  (float64, float32, bfloat16; top-left ``is_causal``). It needs equal head
  dims: the narrower of q/k and v is zero-padded (exact: zero query/key
  columns add nothing to the scores, zero value columns give zero output
  columns) and the result sliced back.
- CUDA: ``_efficient_attention_forward`` / ``_efficient_attention_backward``
  (any d_qk, d_v; ``custom_mask_type`` 1 = top-left causal; [b, s, h, d]).
  Why this one and not flash or cuDNN: docs/BEYOND.md.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

_ATEN = torch.ops.aten


def diagonal_offset(keep) -> Optional[int]:
    """The block kernel interface's visibility -> diagonal offset (None = all visible).

    ``keep`` [rows, B] bool is the causal staircase ``j <= i + o`` with every
    row seeing a key (``o >= 0``), so row 0 sees exactly ``o + 1`` keys.
    """
    if keep is None:
        return None
    return int(keep[0].sum()) - 1


def _calls(offset: Optional[int], num_keys: int):
    """(key slice, top-left causal) of the fused calls that make up one block."""
    if offset is None or offset >= num_keys:
        return [(slice(0, num_keys), False)]
    if offset == 0:
        return [(slice(0, num_keys), True)]
    return [(slice(0, offset), False), (slice(offset, num_keys), True)]


def _merge(parts):
    """Block outputs of disjoint key ranges -> one (out, lse) by log-sum-exp."""
    out, lse = parts[0]
    for o, l in parts[1:]:
        new = torch.logaddexp(lse, l)
        out = out * torch.exp(lse - new).unsqueeze(-1) + o * torch.exp(l - new).unsqueeze(-1)
        lse = new
    return out, lse


def _pad_last(x, width):
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _cpu_lse_dtype(dtype):
    """The CPU op keeps float64's log-sum-exp in float64 and any other's in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class CpuFlash:
    """``_scaled_dot_product_flash_attention_for_cpu`` (+ backward); [b, h, s, d]."""

    @staticmethod
    def forward(q, key, value, causal, scale):
        d = max(q.shape[-1], value.shape[-1])
        out, lse = _ATEN._scaled_dot_product_flash_attention_for_cpu(
            _pad_last(q, d), _pad_last(key, d), _pad_last(value, d), 0.0, causal, scale=scale)
        return out[..., :value.shape[-1]], lse

    @staticmethod
    def backward(q, key, value, causal, scale, d_out, out, lse):
        d = max(q.shape[-1], value.shape[-1])
        dq, dk, dv = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
            _pad_last(d_out, d), _pad_last(q, d), _pad_last(key, d), _pad_last(value, d),
            _pad_last(out, d), lse.to(_cpu_lse_dtype(q.dtype)), 0.0, causal, scale=scale)
        return dq[..., :q.shape[-1]], dk[..., :key.shape[-1]], dv[..., :value.shape[-1]]


_LSE_ALIGN = 32  # the memory-efficient kernel's log-sum-exp rows are padded to this


class CudaEfficient:
    """``_efficient_attention_forward`` / ``_backward``: [b, s, h, d] views of [b, h, s, d]."""

    @staticmethod
    def forward(q, key, value, causal, scale):
        bshd = [x.transpose(1, 2) for x in (q, key, value)]
        out, lse = _ATEN._efficient_attention_forward(
            *bshd, None, None, None, None, None, 0.0, int(causal), True, scale=scale)[:2]
        return out.transpose(1, 2), lse[..., :q.shape[2]]

    @staticmethod
    def backward(q, key, value, causal, scale, d_out, out, lse):
        rows = q.shape[2]
        padded = -(-rows // _LSE_ALIGN) * _LSE_ALIGN
        lse_full = lse.new_zeros(*lse.shape[:-1], padded)
        lse_full[..., :rows] = lse
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        grads = _ATEN._efficient_attention_backward(
            d_out.transpose(1, 2), q.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
            None, out.transpose(1, 2), None, None, rows, key.shape[2], lse_full, 0.0, seed, seed,
            int(causal), False, scale=scale)
        return tuple(g.transpose(1, 2) for g in grads[:3])


# Which op pair runs a block, by device type (a script may swap the CUDA entry to compare).
BACKENDS = {"cpu": CpuFlash, "cuda": CudaEfficient}


def backend_for(device: torch.device):
    if device.type not in BACKENDS:
        raise ValueError(f"kernel='sdpa' with recompute_kv has fused block ops for "
                         f"{sorted(BACKENDS)} tensors, not {device.type!r}; use kernel='eager' "
                         "(or 'npu' on Ascend)")
    return BACKENDS[device.type]


class FusedBlock:
    """Block kernel on fused attention ops: no score matrix, one or two calls a block."""

    @staticmethod
    def forward(q, key, value, keep, scale):
        ops = backend_for(q.device)
        parts = []
        for keys, causal in _calls(diagonal_offset(keep), key.shape[2]):
            out, lse = ops.forward(q, key[:, :, keys], value[:, :, keys], causal, scale)
            parts.append((out.float(), lse.float()))
        return _merge(parts)

    @staticmethod
    def backward(q, key, value, keep, scale, d_out, out, lse):
        ops = backend_for(q.device)
        d_out, out, lse = d_out.to(q.dtype), out.to(q.dtype), lse.float()
        dq, dks, dvs = None, [], []
        for keys, causal in _calls(diagonal_offset(keep), key.shape[2]):
            g_q, g_k, g_v = ops.backward(q, key[:, :, keys], value[:, :, keys], causal, scale,
                                         d_out, out, lse)
            dq = g_q.float() if dq is None else dq + g_q.float()
            dks.append(g_k.float())
            dvs.append(g_v.float())
        return dq, torch.cat(dks, dim=2), torch.cat(dvs, dim=2)

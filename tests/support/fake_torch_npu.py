"""A CPU stand-in for ``torch_npu``: ``npu_fusion_attention`` and its grad (here), the
three sparse-attention ops of DSA (tests/support/fake_dsa_ops.py), and the MX-FP8
quantization and matmul ops of MindSpeed's TE modules (tests/support/fake_npu_quant.py).

Tests install it as ``sys.modules["torch_npu"]`` so the ``kernel="npu"`` path
of mindspeed_laga runs on CPU. The math uses plain torch ops (autograd works
through the forward); softmax runs in float32 like the fused kernel.

Semantics, read from the public documentation (our own code, nothing copied):

- API reference of ``torch_npu.npu_fusion_attention`` (Ascend PyTorch 6.0.0,
  https://hiascend.com/document/detail/zh/Pytorch/600/apiref/apilist/ptaoplist_000850.html):
  the signature and argument names, 7 outputs ``(Tensor, Tensor, Tensor,
  Tensor, int, int, int)``, layouts BSH/SBH/BSND/BNSD/TND, dtypes
  fp16/bf16/fp32, ``atten_mask`` True = masked with shapes BNSS/B1SS/11SS/SS,
  the sparse_mode table, the compressed 2048x2048 mask of modes 2/3/4, and the
  bounds on negative pre/next tokens.
- hicann/ops-transformer ``docs/en/context/sparse_mode_introduction.md``:
  mode 0 = mask + the pre/next band, and no mask means no masking at all
  (pre/next ignored); 1 = full mask; 2 = causal from the upper-left vertex;
  3 = causal from the lower-right vertex; 4 = band counted from the
  lower-right vertex; the compressed mask is ``triu(ones(2048, 2048), 1)``.
- hicann/ops-transformer
  ``attention/flash_attention_score/docs/aclnnFlashAttentionScore_en.md``:
  ``qD == kD and kD >= vD``, key/value equal except D, Nq a multiple of Nkv,
  D in [1, 768], softmaxMax/softmaxSum ``[B, N, Sq, 8]`` float32, "band:
  preTokens and nextTokens must overlap".
- Ascend/op-plugin ``docs/context/torch_npu-npu_fusion_attention.md`` (the
  torch_npu reference of the same op): ``Dq == Dk >= Dv`` in 1..768, Nq in
  1..256 and a multiple of Nkv, the compressed 2048x2048 mask of modes 2/3/4,
  mode 4's band counted from the lower-right vertex, and for a negative
  next (pre) token count: ``pre >= |next|`` and ``|next| < Skv``
  (``next >= |pre|`` and ``|pre| < Sq``).
- The host tiling of FlashAttentionScore (flash_attention_score_tiling_general.cpp,
  e.g. in yueliang13/cann-ops-adv-vllm): mode 0 counts pre/next from the
  upper-left vertex (query i sees keys ``[i - pre, i + next]``); mode 3 with
  Sq != Skv becomes that band with pre = Sq, next = Skv - Sq; mode 4 shifts
  pre/next by Skv - Sq (lower-right vertex). An empty band is rejected.
- Ascend/op-plugin ``op_plugin/python/meta/_meta_registrations.py``: the
  keyword-only signature of ``npu_fusion_attention_grad`` and its outputs
  ``(dq, dk, dv, dpse)`` with ``dpse`` empty when there is no pse.
- MindSpeed ``docs/zh/ops/npu_ring_attention_update.md``: softmax_sum is
  ``sum(exp(score - softmax_max))``, so blocks merge with the max/sum pair.

TND (varlen), from the same op-plugin page and hicann ``FlashAttentionVarLenScore``:
query [T, N, D], key/value [T_kv, N_kv, D] with no batch axis; both
``actual_seq_qlen`` and ``actual_seq_kvlen`` are required host int lists of
cumulative lengths (B in 1..2048 entries, T in 1..1M), never decreasing and
ending at T, with trailing zeros for batches that take no part; a sequence may
have no queries, but one with queries needs keys. Each sequence attends only
its own keys, the sparse modes applied with that sequence's Sq/Skv (mode 3:
causal from each sequence's lower-right vertex, the compressed 2048x2048
mask); no row may be fully masked ("atten_mask does not support padding");
mode 5 is rejected. softmax_max/softmax_sum are [T, N, 8] (the aclnn sample's
shape and MindSpeed's TND ring attention).

Deliberate limits: pse, padding_mask, prefix, dropout (keep_prob < 1), sparse
modes 5-8 (dense layouts), and with TND modes 1, 6-8 and mode 0 with a mask
raise NotImplementedError. Modes 1-4
without a mask raise: the docs say the mask "must be correct" and that with
no mask the op silently computes full attention, which would hide a missing
mask from a test; this is the one place the stand-in is stricter than the
op. Modes 2/3/4 accept
only the exact 2048x2048 ``triu(diagonal=1)`` bool/uint8 mask. Rows whose
keys are all masked give zero output and zero gradients (the kernel's
"invalid line" handling); with a user mask (modes 0/1) such a row needs
``inner_precise=2``, the documented switch for it (Ascend PyTorch 6.0.0
reference: "2 enables invalid-row computation ... to avoid the precision loss of
whole masked rows"), or the call raises. Argument errors raise ``FakeNpuError``, a
RuntimeError like the real op's.

Arguments after ``input_layout`` are keyword-only here: the API reference
lists them positionally, op-plugin's meta registration declares them
keyword-only, so a caller that passes them by name works with either.

Every call is recorded in ``calls`` (layout, head_num, sparse_mode, mask
shape, q/k/v shapes) so tests can check which recipe a caller used, and
``largest_mask_elements`` holds the element count of the largest
``atten_mask`` handed to either op since the last ``reset_calls()``, so a
test can assert that no mask above 2048x2048 ever reached it.
"""
from __future__ import annotations

import sys
import types
from typing import Optional

import torch

from . import fake_npu_quant

INT_MAX = 2147483647
COMPRESSED_MASK_SIZE = 2048
MAX_HEAD_DIM = 768
MAX_HEADS = 256  # Nq
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_PREVIOUS = "_fake_torch_npu_previous"  # key in the module dict: what install() replaced


class FakeNpuError(RuntimeError):
    """An argument the real kernel would reject."""


# ---------------------------------------------------------------- layouts

def _check_layout(input_layout: str, actual_seq_qlen, actual_seq_kvlen):
    if input_layout == "TND":
        if actual_seq_qlen is None or actual_seq_kvlen is None:
            raise FakeNpuError("input_layout='TND' (varlen) needs actual_seq_qlen and "
                               "actual_seq_kvlen (cumulative sequence lengths)")
        return
    if actual_seq_qlen is not None or actual_seq_kvlen is not None:
        raise FakeNpuError(f"actual_seq_qlen/actual_seq_kvlen belong to input_layout='TND', "
                           f"not {input_layout!r}")
    if input_layout not in LAYOUTS:
        raise FakeNpuError(f"input_layout={input_layout!r} is not one of {LAYOUTS + ('TND',)}")


def _head_dim_of(query: torch.Tensor, head_num: int, input_layout: str) -> int:
    if not 1 <= head_num <= MAX_HEADS:
        raise FakeNpuError(f"head_num={head_num} is outside [1, {MAX_HEADS}] (query heads Nq)")
    if input_layout in ("BSH", "SBH"):
        if query.shape[-1] % head_num:
            raise FakeNpuError(f"query hidden size {query.shape[-1]} is not divisible by "
                               f"head_num={head_num}")
        return query.shape[-1] // head_num
    if query.shape[-2 if input_layout == "BSND" else 1] != head_num:
        raise FakeNpuError(f"head_num={head_num} must equal query's N axis ({input_layout} "
                           f"shape {tuple(query.shape)})")
    return query.shape[-1]


def to_bnsd(x: torch.Tensor, input_layout: str, head_dim: Optional[int] = None) -> torch.Tensor:
    """Any supported layout -> [B, N, S, D] (a view). BSH/SBH need ``head_dim``."""
    if x.dim() != (3 if input_layout in ("BSH", "SBH") else 4):
        raise FakeNpuError(f"{input_layout} expects {len(input_layout)} dims, got {tuple(x.shape)}")
    if input_layout == "BNSD":
        return x
    if input_layout == "BSND":
        return x.transpose(1, 2)
    if x.shape[-1] % head_dim:
        raise FakeNpuError(f"hidden size {x.shape[-1]} is not a multiple of head dim {head_dim}")
    if input_layout == "SBH":
        x = x.transpose(0, 1)
    return x.unflatten(-1, (-1, head_dim)).transpose(1, 2)


def from_bnsd(x: torch.Tensor, input_layout: str) -> torch.Tensor:
    """[B, N, S, D] -> the caller's layout (inverse of :func:`to_bnsd`)."""
    if input_layout == "BNSD":
        return x
    x = x.transpose(1, 2)  # [B, S, N, D]
    if input_layout == "BSND":
        return x
    x = x.flatten(-2)
    return x.transpose(0, 1) if input_layout == "SBH" else x


def _bnsd_inputs(query, key, value, head_num: int, input_layout: str):
    """q [B, N1, Sq, D], k [B, N2, Skv, D], v [B, N2, Skv, Dv], checked as the kernel does."""
    dtypes = {query.dtype, key.dtype, value.dtype}
    if len(dtypes) != 1 or query.dtype not in DTYPES:
        raise FakeNpuError(f"query/key/value must share one dtype of {DTYPES}; got "
                           f"{query.dtype}, {key.dtype}, {value.dtype}")
    d = _head_dim_of(query, head_num, input_layout)
    q = to_bnsd(query, input_layout, d)
    k = to_bnsd(key, input_layout, d)
    v_dim = None
    if input_layout in ("BSH", "SBH"):
        v_dim = value.shape[-1] // k.shape[1]
        if v_dim == 0:
            raise FakeNpuError(f"value hidden size {value.shape[-1]} is below the "
                               f"{k.shape[1]} key/value heads")
    v = to_bnsd(value, input_layout, v_dim)
    _check_shapes(q, k, v)
    return q, k, v


def _check_shapes(q, k, v):
    if k.shape[-1] != q.shape[-1] or v.shape[-1] > k.shape[-1]:
        raise FakeNpuError(f"head dims must satisfy qD == kD >= vD; got qD={q.shape[-1]}, "
                           f"kD={k.shape[-1]}, vD={v.shape[-1]}")
    if not 1 <= q.shape[-1] <= MAX_HEAD_DIM:
        raise FakeNpuError(f"head dim {q.shape[-1]} is outside [1, {MAX_HEAD_DIM}]")
    if k.shape[:3] != v.shape[:3]:
        raise FakeNpuError(f"key and value must match except D; got {tuple(k.shape)} (BNSD) "
                           f"and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise FakeNpuError(f"batch sizes differ: query {q.shape[0]}, key {k.shape[0]}")
    if q.shape[1] % k.shape[1]:
        raise FakeNpuError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads "
                           f"({k.shape[1]})")


def expand_groups(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, N2, S, D] -> [B, heads, S, D]: query head h reads key/value head h // (heads / N2)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def reduce_groups(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Inverse of :func:`expand_groups` for gradients: sum each group of query heads."""
    return x.unflatten(1, (kv_heads, -1)).sum(dim=2)


# ---------------------------------------------------------------- masks

_WANT_MASK = {}


def _compressed_mask_ok(mask: torch.Tensor) -> bool:
    size = (COMPRESSED_MASK_SIZE,) * 2
    if tuple(mask.shape) != size or mask.dtype not in (torch.bool, torch.uint8):
        return False
    seen = (mask.data_ptr(), mask._version, mask.dtype)
    if _WANT_MASK.get("seen") == seen:  # the very tensor checked last time, unmodified
        return True
    key = str(mask.device)
    if key not in _WANT_MASK:
        _WANT_MASK[key] = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool,
                                     device=mask.device).triu(diagonal=1)
    ok = torch.equal(mask.bool(), _WANT_MASK[key])
    if ok:
        _WANT_MASK["seen"] = seen
    return ok


def _full_mask(mask: torch.Tensor, b: int, n: int, sq: int, skv: int) -> torch.Tensor:
    """A user mask of shape SS / 11SS / B1SS / BNSS -> bool [B|1, N|1, Sq, Skv], True = masked."""
    if mask.dtype not in (torch.bool, torch.uint8):
        raise FakeNpuError(f"atten_mask must be bool or uint8, got {mask.dtype}")
    shapes = {(sq, skv), (1, 1, sq, skv), (b, 1, sq, skv), (b, n, sq, skv)}
    if tuple(mask.shape) not in shapes:
        raise FakeNpuError(f"atten_mask shape {tuple(mask.shape)} is not one of "
                           f"SS/11SS/B1SS/BNSS for B={b}, N={n}, Sq={sq}, Skv={skv}")
    mask = mask.bool()
    return mask.view(1, 1, sq, skv) if mask.dim() == 2 else mask


def _band(sq: int, skv: int, pre: int, nxt: int, device) -> torch.Tensor:
    """[Sq, Skv] True = visible: key j for query i iff i - pre <= j <= i + nxt.

    The upper-left frame of sparse_mode 0; the other modes are shifted into it.
    """
    if pre + nxt < 0:
        raise FakeNpuError(f"pre_tockens={pre} and next_tockens={nxt} leave no key visible "
                           "(the band must overlap: pre + next >= 0)")
    rows, cols = torch.arange(sq, device=device), torch.arange(skv, device=device)
    offset = cols.view(1, -1) - rows.view(-1, 1)
    return (offset >= -pre) & (offset <= nxt)


def _check_negative_tokens(sq: int, skv: int, pre: int, nxt: int):
    if nxt < 0 and -nxt >= skv:
        raise FakeNpuError(f"next_tockens={nxt}: |next_tockens| must be below Skv={skv}")
    if pre < 0 and -pre >= sq:
        raise FakeNpuError(f"pre_tockens={pre}: |pre_tockens| must be below Sq={sq}")


def visible(atten_mask, sparse_mode: int, pre: int, nxt: int, b: int, n: int, sq: int, skv: int,
            device) -> Optional[torch.Tensor]:
    """Bool [B|1, N|1, Sq, Skv], True = the query may see the key; None = everything visible."""
    if sparse_mode in (5, 6, 7, 8):
        raise NotImplementedError(f"fake torch_npu: sparse_mode={sparse_mode} (prefix/varlen) is "
                                  "not implemented; use 0-4")
    if sparse_mode not in (0, 1, 2, 3, 4):
        raise FakeNpuError(f"sparse_mode={sparse_mode} is not a valid mode (0-8)")
    if sparse_mode == 0:
        if atten_mask is None:
            return None  # documented: no mask -> no masking, pre/next ignored
        _check_negative_tokens(sq, skv, pre, nxt)
        return ~_full_mask(atten_mask, b, n, sq, skv) & _band(sq, skv, pre, nxt, device)
    if atten_mask is None:
        raise FakeNpuError(f"sparse_mode={sparse_mode} needs atten_mask (none was given)")
    if sparse_mode == 1:
        return ~_full_mask(atten_mask, b, n, sq, skv)
    if not _compressed_mask_ok(atten_mask):
        raise FakeNpuError(
            f"sparse_mode={sparse_mode} takes the compressed mask: a bool/uint8 "
            f"[{COMPRESSED_MASK_SIZE}, {COMPRESSED_MASK_SIZE}] triu(diagonal=1) tensor; got "
            f"shape {tuple(atten_mask.shape)}, dtype {atten_mask.dtype}")
    return _compressed_keep(sparse_mode, pre, nxt, sq, skv, device).view(1, 1, sq, skv)


def _compressed_keep(sparse_mode: int, pre: int, nxt: int, sq: int, skv: int, device):
    """[Sq, Skv] visibility of modes 2/3/4 (their compressed mask already checked)."""
    if sparse_mode == 2:
        return _band(sq, skv, INT_MAX, 0, device)
    if sparse_mode == 3:
        return _band(sq, skv, INT_MAX, skv - sq, device)
    return _band(sq, skv, pre - (skv - sq), nxt + (skv - sq), device)  # from the lower-right vertex


# ---------------------------------------------------------------- varlen (TND)

MAX_VARLEN_BATCH = 2048   # B of the cumulative lists
MAX_TOKENS = 1 << 20      # T


def _cumulative(lengths, total: int, name: str):
    """A host list of cumulative lengths -> its per-batch [start, end) ranges.

    Trailing zeros mark batches that take no part; before them the list never
    decreases (a zero-length sequence repeats the previous value) and ends at T.
    """
    if not isinstance(lengths, (list, tuple)) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in lengths):
        raise FakeNpuError(f"{name} must be a host list of ints (cumulative lengths), got "
                           f"{type(lengths).__name__}")
    if not 1 <= len(lengths) <= MAX_VARLEN_BATCH:
        raise FakeNpuError(f"{name} has {len(lengths)} entries; B must be in [1, {MAX_VARLEN_BATCH}]")
    used = len(lengths)
    while used and lengths[used - 1] == 0:
        used -= 1
    ends = list(lengths[:used])
    starts = [0] + ends[:-1]
    if any(e < s for s, e in zip(starts, ends)):
        raise FakeNpuError(f"{name}={list(lengths)} decreases: it holds cumulative lengths")
    if not ends or ends[-1] != total:
        raise FakeNpuError(f"{name}={list(lengths)} must end at the token count T={total}")
    return list(zip(starts, ends)), len(lengths)


def _tnd_inputs(query, key, value, head_num: int):
    """[T, N, D] tensors -> [1, N, T, D] views, checked like the BNSD ones."""
    for x, name in ((query, "query"), (key, "key"), (value, "value")):
        if x.dim() != 3:
            raise FakeNpuError(f"TND expects 3 dims [T, N, D] (no batch axis); {name} has shape "
                               f"{tuple(x.shape)}")
        if not 1 <= x.shape[0] <= MAX_TOKENS:
            raise FakeNpuError(f"{name} has T={x.shape[0]} tokens; T must be in [1, {MAX_TOKENS}]")
    if len({query.dtype, key.dtype, value.dtype}) != 1 or query.dtype not in DTYPES:
        raise FakeNpuError(f"query/key/value must share one dtype of {DTYPES}; got "
                           f"{query.dtype}, {key.dtype}, {value.dtype}")
    if not 1 <= head_num <= MAX_HEADS or query.shape[1] != head_num:
        raise FakeNpuError(f"head_num={head_num} must equal query's N axis (TND shape "
                           f"{tuple(query.shape)}) and lie in [1, {MAX_HEADS}]")
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
    _check_shapes(q, k, v)
    return q, k, v


def _varlen_keep(atten_mask, sparse_mode: int, pre: int, nxt: int, n: int, sq: int, skv: int,
                 device) -> Optional[torch.Tensor]:
    """One sequence's visibility: the dense-layout rules applied with its own Sq/Skv."""
    if sparse_mode == 5:
        raise FakeNpuError("sparse_mode=5 (uncompressed prefix) is not supported with TND")
    if sparse_mode in (1, 6, 7, 8) or (sparse_mode == 0 and atten_mask is not None):
        raise NotImplementedError(f"fake torch_npu: TND with sparse_mode={sparse_mode}"
                                  f"{' and a mask' if sparse_mode == 0 else ''} is not "
                                  "implemented; use 0 without mask or 2/3/4")
    if skv == 0:
        raise FakeNpuError(f"a TND sequence with Sq={sq} queries has no key (Skv=0)")
    if sparse_mode == 0:
        return None  # no mask: every key of the sequence, pre/next ignored
    keep = _compressed_keep(sparse_mode, pre, nxt, sq, skv, device)
    if keep is not None and not bool(keep.any(dim=-1).all()):
        raise FakeNpuError(f"sparse_mode={sparse_mode} leaves a fully masked row in a TND "
                           f"sequence (Sq={sq}, Skv={skv}); varlen rejects masked-out rows")
    return keep


def _varlen_sequences(q, k, atten_mask, sparse_mode, pre, nxt, actual_seq_qlen, actual_seq_kvlen):
    """[(query range, key range, keep)] of the sequences with queries."""
    q_ranges, batches = _cumulative(actual_seq_qlen, q.shape[2], "actual_seq_qlen")
    kv_ranges, kv_batches = _cumulative(actual_seq_kvlen, k.shape[2], "actual_seq_kvlen")
    if batches != kv_batches or len(q_ranges) != len(kv_ranges):
        raise FakeNpuError(f"actual_seq_qlen={list(actual_seq_qlen)} and actual_seq_kvlen="
                           f"{list(actual_seq_kvlen)} describe different batches")
    if sparse_mode in (2, 3, 4):  # one mask for the call, checked once
        visible(atten_mask, sparse_mode, pre, nxt, 1, q.shape[1], 1, 1, q.device)
    return [((qa, qb), (ka, kb),
             _varlen_keep(atten_mask, sparse_mode, pre, nxt, q.shape[1], qb - qa, kb - ka, q.device))
            for (qa, qb), (ka, kb) in zip(q_ranges, kv_ranges) if qb > qa]


def _tnd_forward(query, key, value, head_num, atten_mask, scale, pre, nxt, sparse_mode,
                 actual_seq_qlen, actual_seq_kvlen):
    """Each sequence attends its own keys: out [T, N, Dv], softmax max/sum [T, N, 8]."""
    q, k, v = _tnd_inputs(query, key, value, head_num)
    n = q.shape[1]
    out = torch.zeros(query.shape[0], n, v.shape[-1], dtype=query.dtype, device=query.device)
    stats = torch.zeros(2, query.shape[0], n, 8, dtype=torch.float32, device=query.device)
    parts = []
    for (qa, qb), (ka, kb), keep in _varlen_sequences(q, k, atten_mask, sparse_mode, pre, nxt,
                                                      actual_seq_qlen, actual_seq_kvlen):
        s = _scores(q[:, :, qa:qb], k[:, :, ka:kb], scale, keep)
        row_max, row_sum = _row_stats(s)
        o = torch.matmul(_probs(s, row_max, row_sum), expand_groups(v[:, :, ka:kb], n).float())
        parts.append(((qa, qb), o[0].transpose(0, 1).to(query.dtype)))
        for i, x in enumerate((row_max, row_sum)):
            stats[i, qa:qb] = x.detach()[0].transpose(0, 1).float().expand(qb - qa, n, 8)
    # Sequences cover every query row; index_put keeps autograd through the outputs.
    rows = torch.cat([torch.arange(a, b) for (a, b), _ in parts]).to(query.device)
    out = out.index_put((rows,), torch.cat([o for _, o in parts]))
    return out, stats[0], stats[1]


def _tnd_grad(query, key, value, dy, head_num, atten_mask, softmax_max, softmax_sum,
              attention_in, scale, pre, nxt, sparse_mode, actual_seq_qlen, actual_seq_kvlen):
    q, k, v = _tnd_inputs(query, key, value, head_num)
    n, kv_heads = q.shape[1], k.shape[1]
    want = (query.shape[0], n, 8)
    for x, name in ((softmax_max, "softmax_max"), (softmax_sum, "softmax_sum")):
        if tuple(x.shape) != want:
            raise FakeNpuError(f"{name} must be [T, N, 8] = {list(want)} with TND; got "
                               f"{list(x.shape)}")
    for x, name in ((dy, "dy"), (attention_in, "attention_in")):
        if tuple(x.shape) != (query.shape[0], n, v.shape[-1]):
            raise FakeNpuError(f"{name} must be [T, N, Dv] like the forward output; got "
                               f"{list(x.shape)}")
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    d_out, out = (x.transpose(0, 1).unsqueeze(0).float() for x in (dy, attention_in))
    row_max, row_sum = (x[..., :1].transpose(0, 1).unsqueeze(0).float()
                        for x in (softmax_max, softmax_sum))
    for (qa, qb), (ka, kb), keep in _varlen_sequences(q, k, atten_mask, sparse_mode, pre, nxt,
                                                      actual_seq_qlen, actual_seq_kvlen):
        grads = _grad_math(q[:, :, qa:qb], k[:, :, ka:kb], v[:, :, ka:kb], d_out[:, :, qa:qb],
                           out[:, :, qa:qb], row_max[:, :, qa:qb], row_sum[:, :, qa:qb], scale, keep)
        dq[:, :, qa:qb] += grads[0]
        dk[:, :, ka:kb] += reduce_groups(grads[1], kv_heads)
        dv[:, :, ka:kb] += reduce_groups(grads[2], kv_heads)
    return tuple(x[0].transpose(0, 1).to(t.dtype) for x, t in ((dq, query), (dk, key), (dv, value)))


# ---------------------------------------------------------------- the op

def _check_unsupported(pse, padding_mask, prefix, keep_prob):
    if pse is not None or padding_mask is not None or prefix is not None:
        raise NotImplementedError("fake torch_npu: pse, padding_mask and prefix are not "
                                  "implemented")
    if keep_prob != 1.0:
        raise NotImplementedError("fake torch_npu: dropout (keep_prob < 1) is not implemented")


def _scores(q, k, scale: float, keep: Optional[torch.Tensor]):
    """Scaled scores in float32 with masked entries at -inf: [B, N1, Sq, Skv]."""
    k = expand_groups(k, q.shape[1])
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    return s if keep is None else s.masked_fill(~keep, float("-inf"))


def _probs(s: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor) -> torch.Tensor:
    """exp(s - max) / sum, with all-masked rows (sum 0) giving zeros instead of nan."""
    e = torch.exp(s - row_max)  # masked entries: exp(-inf) = 0
    return torch.where(row_sum > 0, e / row_sum.clamp_min(torch.finfo(e.dtype).tiny), 0.0)


def _row_stats(s: torch.Tensor):
    """Row max (detached: it only shifts the exponent) and sum of exp(s - max)."""
    row_max = s.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    row_sum = torch.exp(s - row_max).sum(dim=-1, keepdim=True)
    return row_max, row_sum


# "raise": a wholly masked row without inner_precise=2 is refused (below); "zero": it is
# computed as with the switch. The real loop sets "zero" for the host's own left-padded SFT
# reference (tests/support/loop/bootstrap), whose pad rows see no key and reach nothing
# that trains there.
UNSPECIFIED_ROWS = "raise"


def _check_invalid_rows(atten_mask, sparse_mode: int, inner_precise: int, b, n, sq, skv):
    """A user mask (modes 0/1) that masks a whole query row: the reference documents
    ``inner_precise=2`` as the switch that computes such "invalid rows" (without it their
    result is not specified: "precision loss"); the op detects them itself only from its
    sparse parameters (e.g. mode 3 with Sq > Skv, a pre/next band), not inside a mask it is
    handed. The stand-in gives them zero output and grads, and refuses a row the mask
    itself masks wholly without the switch."""
    if atten_mask is None or sparse_mode not in (0, 1) or inner_precise == 2:
        return
    if UNSPECIFIED_ROWS == "zero":
        return
    if bool(_full_mask(atten_mask, b, n, sq, skv).all(dim=-1).any()):
        raise FakeNpuError("atten_mask masks every key of some query row; pass inner_precise=2 "
                           "(invalid-row computation) or the op's result for it is unspecified")


def _record(name: str, **info):
    module = sys.modules.get("torch_npu")
    if getattr(module, "IS_FAKE", False):
        module.calls.append(dict(name=name, **info))
        shape = info["atten_mask_shape"]
        if shape is not None:
            elements = 1
            for size in shape:
                elements *= size
            module.largest_mask_elements = max(module.largest_mask_elements, elements)


def _call_info(query, key, value, head_num, input_layout, atten_mask, scale, pre, nxt, sparse_mode,
               actual_seq_qlen=None, actual_seq_kvlen=None):
    return dict(input_layout=input_layout, head_num=head_num, sparse_mode=sparse_mode,
                actual_seq_qlen=None if actual_seq_qlen is None else list(actual_seq_qlen),
                actual_seq_kvlen=None if actual_seq_kvlen is None else list(actual_seq_kvlen),
                pre_tockens=pre, next_tockens=nxt, scale=scale,
                atten_mask_shape=None if atten_mask is None else tuple(atten_mask.shape),
                query_shape=tuple(query.shape), key_shape=tuple(key.shape),
                value_shape=tuple(value.shape))


def npu_fusion_attention(query, key, value, head_num, input_layout, *, pse=None, padding_mask=None,
                         atten_mask=None, scale=1., keep_prob=1., pre_tockens=INT_MAX,
                         next_tockens=INT_MAX, inner_precise=0, prefix=None, actual_seq_qlen=None,
                         actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False):
    """Returns (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)."""
    _check_layout(input_layout, actual_seq_qlen, actual_seq_kvlen)
    _check_unsupported(pse, padding_mask, prefix, keep_prob)
    if input_layout == "TND":
        out, row_max, row_sum = _tnd_forward(query, key, value, head_num, atten_mask, scale,
                                             pre_tockens, next_tockens, sparse_mode,
                                             actual_seq_qlen, actual_seq_kvlen)
        _record("npu_fusion_attention", **_call_info(
            query, key, value, head_num, input_layout, atten_mask, scale, pre_tockens,
            next_tockens, sparse_mode, actual_seq_qlen, actual_seq_kvlen))
        return out, row_max, row_sum, query.new_empty([0]), 0, 0, 0
    q, k, v = _bnsd_inputs(query, key, value, head_num, input_layout)
    (b, n, sq, _), skv = q.shape, k.shape[2]
    keep = visible(atten_mask, sparse_mode, pre_tockens, next_tockens, b, n, sq, skv, q.device)
    _check_invalid_rows(atten_mask, sparse_mode, inner_precise, b, n, sq, skv)
    _record("npu_fusion_attention", **_call_info(query, key, value, head_num, input_layout,
                                                 atten_mask, scale, pre_tockens, next_tockens,
                                                 sparse_mode))
    s = _scores(q, k, scale, keep)
    row_max, row_sum = _row_stats(s)
    p = _probs(s, row_max, row_sum)
    out = torch.matmul(p, expand_groups(v, n).float()).to(query.dtype)
    stats = [x.detach().float().expand(b, n, sq, 8).contiguous() for x in (row_max, row_sum)]
    return (from_bnsd(out, input_layout), stats[0], stats[1], query.new_empty([0]), 0, 0, 0)


def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None,
                              padding_mask=None, atten_mask=None, softmax_max=None,
                              softmax_sum=None, softmax_in=None, attention_in=None,
                              scale_value=1., keep_prob=1., pre_tockens=INT_MAX,
                              next_tockens=INT_MAX, inner_precise=0, seed=0, offset=0, numels=0,
                              prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                              sparse_mode=0, gen_mask_parallel=True, sync=False):
    """Flash-attention backward from the saved row max/sum: returns (dq, dk, dv, dpse)."""
    _check_layout(input_layout, actual_seq_qlen, actual_seq_kvlen)
    _check_unsupported(pse, padding_mask, prefix, keep_prob)
    if softmax_max is None or softmax_sum is None or attention_in is None:
        raise FakeNpuError("npu_fusion_attention_grad needs softmax_max, softmax_sum and "
                           "attention_in from the forward")
    if input_layout == "TND":
        grads = _tnd_grad(query, key, value, dy, head_num, atten_mask, softmax_max, softmax_sum,
                          attention_in, scale_value, pre_tockens, next_tockens, sparse_mode,
                          actual_seq_qlen, actual_seq_kvlen)
        _record("npu_fusion_attention_grad", **_call_info(
            query, key, value, head_num, input_layout, atten_mask, scale_value, pre_tockens,
            next_tockens, sparse_mode, actual_seq_qlen, actual_seq_kvlen))
        return grads + (query.new_empty([0]),)
    q, k, v = _bnsd_inputs(query, key, value, head_num, input_layout)
    (b, n, sq, _), (kv_heads, skv) = q.shape, k.shape[1:3]
    keep = visible(atten_mask, sparse_mode, pre_tockens, next_tockens, b, n, sq, skv, q.device)
    _check_invalid_rows(atten_mask, sparse_mode, inner_precise, b, n, sq, skv)
    _record("npu_fusion_attention_grad", **_call_info(query, key, value, head_num, input_layout,
                                                      atten_mask, scale_value, pre_tockens,
                                                      next_tockens, sparse_mode))
    d_out = to_bnsd(dy, input_layout, v.shape[-1]).float()
    out = to_bnsd(attention_in, input_layout, v.shape[-1]).float()
    dq, dk, dv = _grad_math(q, k, v, d_out, out, softmax_max[..., :1].float(),
                            softmax_sum[..., :1].float(), scale_value, keep)
    return (from_bnsd(dq.to(query.dtype), input_layout),
            from_bnsd(reduce_groups(dk, kv_heads).to(key.dtype), input_layout),
            from_bnsd(reduce_groups(dv, kv_heads).to(value.dtype), input_layout),
            query.new_empty([0]))


def _grad_math(q, k, v, d_out, out, row_max, row_sum, scale: float, keep):
    """float32 (dq, dk, dv) with dk/dv per *query* head (callers sum the groups)."""
    n = q.shape[1]
    p = _probs(_scores(q, k, scale, keep), row_max, row_sum)
    v_full, k_full = expand_groups(v, n).float(), expand_groups(k, n).float()
    dv = torch.matmul(p.transpose(-1, -2), d_out)
    dp = torch.matmul(d_out, v_full.transpose(-1, -2))
    row_dot = (d_out * out).sum(dim=-1, keepdim=True)  # = rowsum(P * dP)
    ds = p * (dp - row_dot) * scale
    return torch.matmul(ds, k_full), torch.matmul(ds.transpose(-1, -2), q.float()), dv


# ---------------------------------------------------------------- install

def _build() -> types.ModuleType:
    module = types.ModuleType("torch_npu", "CPU stand-in for torch_npu (tests/support/fake_torch_npu.py)")
    module.__file__ = __file__
    module.__version__ = "0.0.0+fake"
    module.IS_FAKE = True
    module.calls = []
    module.largest_mask_elements = 0

    def reset_calls():
        module.calls.clear()
        module.largest_mask_elements = 0

    module.reset_calls = reset_calls
    module.npu_fusion_attention = npu_fusion_attention
    module.npu_fusion_attention_grad = npu_fusion_attention_grad
    from . import fake_dsa_ops  # the sparse-attention (DSA) ops, in their own file
    for name, op in fake_dsa_ops.OPS.items():
        setattr(module, name, op)
    fake_npu_quant.register(module)  # the MX-FP8 ops of MindSpeed's TE modules
    return module


def install() -> types.ModuleType:
    """Put the stand-in in ``sys.modules["torch_npu"]`` (idempotent) and return it."""
    current = sys.modules.get("torch_npu")
    if getattr(current, "IS_FAKE", False):
        return current
    module = _build()
    module.__dict__[_PREVIOUS] = current
    sys.modules["torch_npu"] = module
    return module


def uninstall() -> None:
    """Restore whatever ``torch_npu`` was before :func:`install` (nothing if it was absent)."""
    current = sys.modules.get("torch_npu")
    if not getattr(current, "IS_FAKE", False):
        return
    previous = current.__dict__.get(_PREVIOUS)
    if previous is None:
        del sys.modules["torch_npu"]
    else:
        sys.modules["torch_npu"] = previous

"""CPU stand-ins for the torch_npu ops of DeepSeek Sparse Attention (DSA).

``torch_npu.npu_lightning_indexer``, ``torch_npu.npu_sparse_flash_attention`` and
``torch_npu.npu_sparse_lightning_indexer_grad_kl_loss``: the three ops MindSpeed-LLM's
fused DSA paths call (the indexer's top-k, the absorbed sparse attention, the indexer's
KL loss with its grads). tests/support/fake_torch_npu.py puts them on its ``torch_npu``.
The math is plain torch (our own code, nothing copied), written from the documentation:

- Ascend/op-plugin ``docs/context/torch_npu-npu_lightning_indexer.md``: the signature
  (three positional tensors, the rest keyword-only), ``I[t, j] = sum_h W[t, h] *
  ReLU(q[t, h] . k[j])`` and its top-k, query [B, S1, N1, D] or [T1, N1, D], key with
  N2 = 1, weights [B, S1, N1] or [T1, N1], D = 128, fp16/bf16 only and all three alike,
  sparse_count in [1, 2048], sparse_mode 0 (no mask) or 3 (causal from the lower-right
  vertex: query i of S1 sees keys j <= S2 - S1 + i), pre/next tokens only their default,
  int32 ``actual_seq_lengths_*`` (cumulative and required for TND), outputs
  ``sparse_indices`` int32 [B, S1, N2, K] or [T1, N2, K] and ``sparse_values`` in the
  query's dtype (op-plugin ``LightningIndexerKernelNpuOpApi.cpp``; an empty tensor
  unless ``return_value``). The checks are those of hicann/ops-transformer
  ``lightning_indexer_tiling.cpp`` (layouts, N2 = 1, D = 128, dtypes, sparse_count,
  sparse_mode, pre/next tokens, layout_query == layout_key outside PageAttention).
- hicann/ops-transformer ``aclnnLightningIndexerGrad``: the op has a backward from the
  selected values to query, key and weights (dW, dQ, and dK scattered onto the selected
  keys); here autograd runs through the same math.
- Ascend/op-plugin ``docs/context/torch_npu-npu_sparse_flash_attention.md``:
  ``softmax(Q K~^T * scale) V~`` over the keys ``sparse_indices`` names; signature
  (five positional, the rest keyword-only); query [B, S1, N1, 512], N1 in 1..128 powers
  of two, key/value [B, S2, 1, 512] (N2 = 1) of one dtype (fp16/bf16), query_rope /
  key_rope with D = 64; ``attention_mode`` only 2 (MLA-absorb: nope and rope parts are
  concatenated along D, key and value share one tensor); sparse_indices int32
  [B, S1, N2, K] with the valid entries first and the invalid ones (-1) after;
  sparse_mode 0 or 3; softmax_max / softmax_sum float32 [B, N2, S1, N1/N2] when
  ``return_softmax_lse`` (empty otherwise). Grads flow to query, key, value and the
  two rope tensors (the training op's grad kernel).
- Ascend/op-plugin ``docs/context/torch_npu-npu_sparse_lightning_indexer_grad_kl_loss.md``
  and hicann ``aclnnSparseLightningIndexerGradKLLoss``: the target ``p[t]`` is the
  main attention's probabilities (recomputed from query/key/rope with the forward's
  softmax_max and softmax_sum) summed over heads and L1-normalised over the selected
  keys; ``loss = sum_t KL(p[t] || softmax(I[t]))`` over the selected keys, a float32
  tensor of shape [1]; ``dI = softmax(I) - p`` and from it d_weights, d_query_index
  and d_key_index (grads of that summed loss, in their inputs' dtypes). Only
  sparse_mode 3, layouts BSND/TND, N1 in {8, 16, 32, 64, 128}, index heads in
  {8, 16, 32, 64}, N2 = index N2 = 1, D = 512, rope D = 64, index D = 128 (the
  indexer's), softmax_max / softmax_sum float32 [B, N2, S1, G].

Choices the documents leave open, made here and stated: top-k ties go to the lower
key index (so every rank and every CP size picks the same keys); invalid top-k slots
(a query with fewer visible keys than sparse_count) hold index -1 and value -inf, as
the host's torch path gives; a query row with no valid index has zero attention
output, zero softmax_max/softmax_sum, and adds nothing to the loss. Indices outside
[0, S2) and a valid index after an invalid one raise (the op would read garbage).
Deliberate limits: PageAttention (``PA_BSND``, ``block_table``) and
``sparse_block_size`` > 1 raise NotImplementedError.

Strictness: arguments the real op rejects raise ``FakeNpuError``. The one switch beyond
the op is :func:`wide_dtypes`: inside it float32 and float64 inputs are also taken and
the math runs in that dtype, so exactness tests can compare against float64 references
sharply; outside it, as on the NPU, only fp16/bf16 pass (the math runs in float32).
``FAKE_TORCH_NPU_WIDE_DTYPES=1`` in the environment does the same for whole processes
(ranks a test spawns, such as the real training loop's, which trains in float32).
"""
from __future__ import annotations

import contextlib
import os
from typing import List, Optional, Tuple

import torch

from .fake_torch_npu import FakeNpuError
from .host_syncs import stand_in_checks

INT64_MAX = 2 ** 63 - 1
NPU_DTYPES = (torch.float16, torch.bfloat16)
WIDE_DTYPES = (torch.float32, torch.float64)
INDEX_HEAD_DIM = 128
LATENT_DIM = 512
ROPE_DIM = 64
MAX_SPARSE_COUNT = 2048
SFA_QUERY_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
KL_QUERY_HEADS = (8, 16, 32, 64, 128)
KL_INDEX_HEADS = (8, 16, 32, 64)

_wide = [False]
# the same switch for processes a test spawns (the real loop's ranks train in float32)
WIDE_ENV = "FAKE_TORCH_NPU_WIDE_DTYPES"


@contextlib.contextmanager
def wide_dtypes():
    """Also accept float32/float64 inputs (tests only; the real ops take fp16/bf16)."""
    _wide.append(True)
    try:
        yield
    finally:
        _wide.pop()


def _allowed_dtypes():
    wide = _wide[-1] or os.environ.get(WIDE_ENV) == "1"
    return NPU_DTYPES + WIDE_DTYPES if wide else NPU_DTYPES


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels accumulate in float32; wide inputs keep their own precision."""
    return dtype if dtype in WIDE_DTYPES else torch.float32


def _check_dtypes(op: str, **tensors):
    dtypes = {t.dtype for t in tensors.values()}
    names = ", ".join(f"{n} {t.dtype}" for n, t in tensors.items())
    if len(dtypes) != 1 or next(iter(dtypes)) not in _allowed_dtypes():
        raise FakeNpuError(f"{op}: {', '.join(tensors)} must share one dtype of "
                           f"{_allowed_dtypes()}; got {names}")


def _check(condition: bool, op: str, message: str):
    if not condition:
        raise FakeNpuError(f"{op}: {message}")


def _check_layouts(op: str, layout_q: str, layout_k: str):
    if layout_k == "PA_BSND":
        raise NotImplementedError(f"{op}: PageAttention (PA_BSND) is not in the stand-in")
    _check(layout_q in ("BSND", "TND"), op, f"layout_query must be BSND or TND, got {layout_q!r}")
    _check(layout_k == layout_q, op,
           f"outside PageAttention layout_key must equal layout_query ({layout_q!r}), got {layout_k!r}")


def _check_dim(op: str, name: str, tensor: torch.Tensor, dims: int):
    _check(tensor.dim() == dims, op, f"{name} must have {dims} dims, got shape {tuple(tensor.shape)}")


# ------------------------------------------------------------ sequences

def _cumulative(op: str, name: str, lengths, total: int) -> List[int]:
    if lengths is None:
        raise FakeNpuError(f"{op}: {name} is required with layout TND")
    values = _int_list(op, name, lengths)
    _check(len(values) > 0 and all(b >= a for a, b in zip([0] + values, values)), op,
           f"{name} must be non-decreasing cumulative lengths, got {values}")
    _check(values[-1] == total, op, f"{name} must end at the token count {total}, got {values}")
    return values


def _int_list(op: str, name: str, lengths) -> List[int]:
    if isinstance(lengths, torch.Tensor):
        _check(lengths.dtype in (torch.int32, torch.int64), op,
               f"{name} must be an integer tensor, got {lengths.dtype}")
        with stand_in_checks():  # the real op takes the tensor as it is
            return [int(v) for v in lengths.reshape(-1).tolist()]
    return [int(v) for v in lengths]


def _spans(op, layout, n_batch, s_q, s_k, lengths_q, lengths_k, int32_lengths=True):
    """Per batch: ((q_start, q_len), (k_start, k_len)) in the flattened token axis."""
    if layout == "TND":
        cq = _cumulative(op, "actual_seq_lengths_query", lengths_q, s_q)
        ck = _cumulative(op, "actual_seq_lengths_key", lengths_k, s_k)
        _check(len(cq) == len(ck), op, "TND needs as many query as key lengths")
        starts_q, starts_k = [0] + cq[:-1], [0] + ck[:-1]
        return [((a, b - a), (c, d - c)) for a, b, c, d in zip(starts_q, cq, starts_k, ck)]
    if int32_lengths:
        for name, lengths in (("actual_seq_lengths_query", lengths_q), ("actual_seq_lengths_key", lengths_k)):
            _check(lengths is None or (isinstance(lengths, torch.Tensor) and lengths.dtype == torch.int32),
                   op, f"{name} must be an int32 tensor")
    lq = [s_q] * n_batch if lengths_q is None else _int_list(op, "actual_seq_lengths_query", lengths_q)
    lk = [s_k] * n_batch if lengths_k is None else _int_list(op, "actual_seq_lengths_key", lengths_k)
    _check(len(lq) == n_batch and len(lk) == n_batch, op, f"actual lengths must have B = {n_batch} entries")
    _check(all(0 <= v <= s_q for v in lq) and all(0 <= v <= s_k for v in lk), op,
           "actual lengths must lie in [0, S]")
    return [((b * s_q, q), (b * s_k, k)) for b, (q, k) in enumerate(zip(lq, lk))]


def _tokens(x: torch.Tensor, layout: str) -> torch.Tensor:
    """BSND [B, S, ...] or TND [T, ...] -> [tokens, ...]."""
    return x.reshape(-1, *x.shape[2:]) if layout == "BSND" else x


def _visible(sparse_mode: int, s_q: int, s_k: int, device) -> torch.Tensor:
    """[s_q, s_k] bool: mode 3 is causal from the lower-right vertex, mode 0 no mask."""
    if sparse_mode == 0:
        return torch.ones(s_q, s_k, dtype=torch.bool, device=device)
    rows = torch.arange(s_q, device=device).unsqueeze(1)
    return torch.arange(s_k, device=device).unsqueeze(0) <= rows + (s_k - s_q)


# ------------------------------------------------------------ npu_lightning_indexer

def index_scores(query: torch.Tensor, key: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[Sq, N1, D], [Sk, D], [Sq, N1] -> [Sq, Sk]: sum_h w * relu(q . k)."""
    return (torch.relu(torch.einsum("qhd,kd->qhk", query, key)) * weights.unsqueeze(-1)).sum(1)


def top_k(scores: torch.Tensor, visible: torch.Tensor, count: int):
    """Largest first, ties to the lower key index; slots past the visible keys: -1 / -inf."""
    masked = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(masked.detach(), dim=-1, descending=True, stable=True).indices[:, :count]
    values = masked.gather(-1, order)
    keep = visible.gather(-1, order)
    indices = torch.where(keep, order, torch.full_like(order, -1))
    if order.shape[-1] < count:  # fewer keys than sparse_count
        pad = count - order.shape[-1]
        indices = torch.cat([indices, indices.new_full((indices.shape[0], pad), -1)], -1)
        values = torch.cat([values, values.new_full((values.shape[0], pad), float("-inf"))], -1)
    return indices, values


def _check_indexer(query, key, weights, layout_query, layout_key, sparse_count, sparse_mode,
                   pre_tokens, next_tokens, block_table):
    op = "npu_lightning_indexer"
    _check_layouts(op, layout_query, layout_key)
    if block_table is not None:
        raise FakeNpuError(f"{op}: block_table must be None unless layout_key is PA_BSND")
    _check_dtypes(op, query=query, key=key, weights=weights)
    dims = 4 if layout_query == "BSND" else 3
    _check_dim(op, "query", query, dims)
    _check_dim(op, "key", key, dims)
    _check_dim(op, "weights", weights, dims - 1)
    _check(query.numel() > 0 and key.numel() > 0, op, "query and key must not be empty")
    _check(key.shape[-2] == 1, op, f"key's head count N2 must be 1, got {key.shape[-2]}")
    _check(query.shape[-1] == INDEX_HEAD_DIM and key.shape[-1] == INDEX_HEAD_DIM, op,
           f"query and key head dim must be {INDEX_HEAD_DIM}, got {query.shape[-1]}, {key.shape[-1]}")
    _check(tuple(weights.shape) == tuple(query.shape[:-1]), op,
           f"weights must be {tuple(query.shape[:-1])}, got {tuple(weights.shape)}")
    if layout_query == "BSND":
        _check(key.shape[0] == query.shape[0], op, "query and key batch sizes differ")
    _check(0 < sparse_count <= MAX_SPARSE_COUNT, op, f"sparse_count must be in [1, 2048], got {sparse_count}")
    _check(sparse_mode in (0, 3), op, f"sparse_mode must be 0 or 3, got {sparse_mode}")
    _check(pre_tokens == INT64_MAX and next_tokens == INT64_MAX, op,
           "pre_tokens and next_tokens support only their default 2^63-1")


def npu_lightning_indexer(query, key, weights, *, actual_seq_lengths_query=None,
                          actual_seq_lengths_key=None, block_table=None, layout_query="BSND",
                          layout_key="BSND", sparse_count=2048, sparse_mode=3,
                          pre_tokens=INT64_MAX, next_tokens=INT64_MAX, return_value=False):
    _check_indexer(query, key, weights, layout_query, layout_key, sparse_count, sparse_mode,
                   pre_tokens, next_tokens, block_table)
    math = _math_dtype(query.dtype)
    q, k, w = (_tokens(x, layout_query).to(math) for x in (query, key, weights))
    n_batch = query.shape[0] if layout_query == "BSND" else 0
    s_q = query.shape[1] if layout_query == "BSND" else query.shape[0]
    s_k = key.shape[1] if layout_query == "BSND" else key.shape[0]
    spans = _spans("npu_lightning_indexer", layout_query, n_batch, s_q, s_k,
                   actual_seq_lengths_query, actual_seq_lengths_key)
    indices = torch.full((q.shape[0], sparse_count), -1, dtype=torch.int32)
    values = [torch.full((q.shape[0], sparse_count), float("-inf"), dtype=math)]
    for (q0, lq), (k0, lk) in spans:
        if lq == 0:
            continue
        scores = index_scores(q[q0:q0 + lq], k[k0:k0 + lk, 0], w[q0:q0 + lq])
        idx, val = top_k(scores, _visible(sparse_mode, lq, lk, q.device), sparse_count)
        indices[q0:q0 + lq] = idx.to(torch.int32)
        values.append((q0, lq, val))
    sparse_values = _assemble_values(values, query.dtype)
    out_shape = (*query.shape[:-2], 1, sparse_count)
    if not return_value:
        sparse_values = torch.empty(0, dtype=query.dtype)
    else:
        sparse_values = sparse_values.reshape(out_shape)
    return indices.reshape(out_shape), sparse_values


def _assemble_values(parts, dtype):
    """Differentiable assembly of the per-sequence top-k values."""
    full, rows = parts[0], []
    cursor = 0
    for q0, lq, val in parts[1:]:
        rows += [full[cursor:q0], val]
        cursor = q0 + lq
    rows.append(full[cursor:])
    return torch.cat(rows).to(dtype)


# ------------------------------------------------------------ npu_sparse_flash_attention

def _check_selection(op: str, indices: torch.Tensor, s_k: int):
    with stand_in_checks():  # the real op reads none of it on the host
        _check_selection_values(op, indices, s_k)


def _check_selection_values(op: str, indices: torch.Tensor, s_k: int):
    valid = indices >= 0
    _check(bool((indices[valid] < s_k).all()), op, f"sparse_indices must lie in [0, {s_k}) or be -1")
    _check(bool((indices >= -1).all()), op, "invalid sparse_indices must be -1")
    later_valid = valid.flip(-1).cummax(-1).values.flip(-1)  # a valid entry at or after
    _check(bool((valid | ~later_valid).all()), op,
           "sparse_indices must hold the valid entries first and the -1 entries after")


def _check_sfa(query, key, value, sparse_indices, query_rope, key_rope, sparse_block_size,
               layout_query, layout_kv, sparse_mode, pre_tokens, next_tokens, attention_mode, block_table):
    op = "npu_sparse_flash_attention"
    _check_layouts(op, layout_query, layout_kv)
    if block_table is not None:
        raise NotImplementedError(f"{op}: block_table (PageAttention) is not in the stand-in")
    if sparse_block_size != 1:
        raise NotImplementedError(f"{op}: sparse_block_size > 1 (block-wise) is not in the stand-in")
    _check(attention_mode == 2, op, f"attention_mode supports only 2 (MLA-absorb), got {attention_mode}")
    _check(query_rope is not None and key_rope is not None, op, "attention_mode 2 needs query_rope and key_rope")
    _check_dtypes(op, query=query, key=key, value=value, query_rope=query_rope, key_rope=key_rope)
    dims = 4 if layout_query == "BSND" else 3
    for name, t in (("query", query), ("key", key), ("value", value), ("query_rope", query_rope),
                    ("key_rope", key_rope), ("sparse_indices", sparse_indices)):
        _check_dim(op, name, t, dims)
    _check(tuple(key.shape) == tuple(value.shape), op, "key and value must have one shape")
    _check(key.shape[-2] == 1, op, f"key/value head count must be 1, got {key.shape[-2]}")
    _check(query.shape[-2] in SFA_QUERY_HEADS, op, f"query heads must be one of {SFA_QUERY_HEADS}")
    _check(query.shape[-1] == LATENT_DIM and key.shape[-1] == LATENT_DIM, op,
           f"query/key/value head dim must be {LATENT_DIM}")
    _check(query_rope.shape[-1] == ROPE_DIM and key_rope.shape[-1] == ROPE_DIM, op,
           f"query_rope/key_rope head dim must be {ROPE_DIM}")
    _check(tuple(query_rope.shape[:-1]) == tuple(query.shape[:-1])
           and tuple(key_rope.shape[:-1]) == tuple(key.shape[:-1]), op, "rope shapes must follow query/key")
    _check(sparse_indices.dtype == torch.int32, op, f"sparse_indices must be int32, got {sparse_indices.dtype}")
    _check(tuple(sparse_indices.shape[:-1]) == (*query.shape[:-2], 1) and sparse_indices.shape[-1] > 0, op,
           f"sparse_indices must be {(*query.shape[:-2], 1)} + (K,), got {tuple(sparse_indices.shape)}")
    _check(sparse_mode in (0, 3), op, f"sparse_mode must be 0 or 3, got {sparse_mode}")
    _check(pre_tokens == INT64_MAX and next_tokens == INT64_MAX, op,
           "pre_tokens and next_tokens support only their default 2^63-1")


def selected_scores(q, q_rope, k, k_rope, idx, scale, visible):
    """Absorbed MQA scores of each query against its selected keys.

    q [Sq, N1, 512], q_rope [Sq, N1, 64], k [Sk, 512], k_rope [Sk, 64], idx [Sq, K]
    -> scores [Sq, N1, K] (-inf where the slot is invalid) and the gathered keys.
    """
    valid = idx >= 0
    safe = idx.clamp_min(0).long()
    keep = valid & visible.gather(-1, safe)
    k_sel, kr_sel = k[safe], k_rope[safe]  # [Sq, K, D]
    s = torch.einsum("qhd,qkd->qhk", q, k_sel) + torch.einsum("qhd,qkd->qhk", q_rope, kr_sel)
    return (s * scale).masked_fill(~keep.unsqueeze(1), float("-inf")), safe, keep


def _sfa_sequence(q, q_rope, k, v, k_rope, idx, scale, visible):
    s, safe, keep = selected_scores(q, q_rope, k, k_rope, idx, scale, visible)
    row_max = s.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(s - row_max)
    row_sum = e.sum(-1, keepdim=True)
    p = torch.where(row_sum > 0, e / row_sum.clamp_min(torch.finfo(e.dtype).tiny), torch.zeros_like(e))
    out = torch.einsum("qhk,qkd->qhd", p, v[safe])
    return out, row_max.squeeze(-1), row_sum.squeeze(-1)


def npu_sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, block_table=None,
                               actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                               key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                               sparse_mode=3, pre_tokens=INT64_MAX, next_tokens=INT64_MAX, attention_mode=0,
                               return_softmax_lse=False):
    _check_sfa(query, key, value, sparse_indices, query_rope, key_rope, sparse_block_size, layout_query,
               layout_kv, sparse_mode, pre_tokens, next_tokens, attention_mode, block_table)
    op = "npu_sparse_flash_attention"
    math = _math_dtype(query.dtype)
    q, qr, k, v, kr = (_tokens(x, layout_query).to(math) for x in (query, query_rope, key, value, key_rope))
    idx = _tokens(sparse_indices, layout_query)[:, 0]
    n_batch = query.shape[0] if layout_query == "BSND" else 0
    s_q = query.shape[1] if layout_query == "BSND" else query.shape[0]
    s_k = key.shape[1] if layout_query == "BSND" else key.shape[0]
    spans = _spans(op, layout_query, n_batch, s_q, s_k, actual_seq_lengths_query, actual_seq_lengths_kv)
    heads = query.shape[-2]
    outs, maxes, sums, cursor = [], [], [], 0
    for (q0, lq), (k0, lk) in spans:
        _check_selection(op, idx[q0:q0 + lq], lk)
        pad = q0 - cursor  # query rows past the actual length of the previous batch
        _pad_rows(outs, maxes, sums, pad, heads, math)
        if lq:
            o, m, s = _sfa_sequence(q[q0:q0 + lq], qr[q0:q0 + lq], k[k0:k0 + lk, 0], v[k0:k0 + lk, 0],
                                    kr[k0:k0 + lk, 0], idx[q0:q0 + lq], scale_value,
                                    _visible(sparse_mode, lq, lk, q.device))
            outs.append(o)
            maxes.append(m)
            sums.append(s)
        cursor = q0 + lq
    _pad_rows(outs, maxes, sums, q.shape[0] - cursor, heads, math)
    out = torch.cat(outs).to(query.dtype).reshape(*query.shape[:-1], LATENT_DIM)
    softmax_max, softmax_sum = (_lse_layout(torch.cat(x).detach().float(), query, layout_query)
                                for x in (maxes, sums))
    if not return_softmax_lse:
        softmax_max = softmax_sum = torch.empty(0, dtype=torch.float32)
    return out, softmax_max, softmax_sum


def _pad_rows(outs, maxes, sums, rows, heads, dtype):
    if rows > 0:
        outs.append(torch.zeros(rows, heads, LATENT_DIM, dtype=dtype))
        maxes.append(torch.zeros(rows, heads, dtype=dtype))
        sums.append(torch.zeros(rows, heads, dtype=dtype))


def _lse_layout(stat: torch.Tensor, query: torch.Tensor, layout: str) -> torch.Tensor:
    """[tokens, N1] -> [B, N2=1, S1, N1] (BSND) or [N2=1, T1, N1] (TND)."""
    if layout == "BSND":
        return stat.reshape(query.shape[0], query.shape[1], -1).unsqueeze(1)
    return stat.unsqueeze(0)


# ------------------------------------------------------------ npu_sparse_lightning_indexer_grad_kl_loss

def _check_kl(query, key, query_index, key_index, weights, sparse_indices, softmax_max, softmax_sum,
              query_rope, key_rope, layout, sparse_mode):
    op = "npu_sparse_lightning_indexer_grad_kl_loss"
    _check(layout in ("BSND", "TND"), op, f"layout must be BSND or TND, got {layout!r}")
    _check(sparse_mode == 3, op, f"sparse_mode supports only 3, got {sparse_mode}")
    _check_dtypes(op, query=query, key=key, query_index=query_index, key_index=key_index)
    _check(weights.dtype in _allowed_dtypes(), op, f"weights must be one of {_allowed_dtypes()}")
    dims = 4 if layout == "BSND" else 3
    for name, t in (("query", query), ("key", key), ("query_index", query_index), ("key_index", key_index),
                    ("sparse_indices", sparse_indices)):
        _check_dim(op, name, t, dims)
    _check_dim(op, "weights", weights, dims - 1)
    _check(query.shape[-2] in KL_QUERY_HEADS, op, f"query heads must be one of {KL_QUERY_HEADS}")
    _check(query_index.shape[-2] in KL_INDEX_HEADS, op, f"index heads must be one of {KL_INDEX_HEADS}")
    _check(key.shape[-2] == 1 and key_index.shape[-2] == 1, op, "key and key_index must have one head")
    _check(query.shape[-1] == LATENT_DIM and key.shape[-1] == LATENT_DIM, op,
           f"query/key head dim must be {LATENT_DIM}")
    _check(query_index.shape[-1] == INDEX_HEAD_DIM and key_index.shape[-1] == INDEX_HEAD_DIM, op,
           f"query_index/key_index head dim must be {INDEX_HEAD_DIM}")
    _check(tuple(weights.shape) == tuple(query_index.shape[:-1]), op,
           "weights must be query_index's shape minus D")
    _check((query_rope is None) == (key_rope is None), op, "query_rope and key_rope go together")
    if query_rope is not None:
        _check_dtypes(op, query=query, query_rope=query_rope, key_rope=key_rope)
        _check(query_rope.shape[-1] == ROPE_DIM and key_rope.shape[-1] == ROPE_DIM, op,
               f"rope head dim must be {ROPE_DIM}")
    _check(sparse_indices.dtype == torch.int32, op, f"sparse_indices must be int32, got {sparse_indices.dtype}")
    want = (query.shape[0], 1, query.shape[1], query.shape[2]) if layout == "BSND" else (1, *query.shape[:2])
    for name, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        _check(t.dtype == torch.float32 and tuple(t.shape) == want, op, f"{name} must be float32 {want}, "
               f"got {t.dtype} {tuple(t.shape)}")


def _kl_sequence(q, qr, k, kr, qi, ki, w, idx, smax, ssum, scale, visible):
    """Summed KL loss of one sequence; qi, ki, w carry grad."""
    if qr is None:
        qr, kr = q[..., :0], k[..., :0]
    s, safe, keep = selected_scores(q, qr, k, kr, idx, scale, visible)
    probs = torch.exp(s - smax.unsqueeze(-1)) / ssum.unsqueeze(-1)
    target = torch.where(keep, probs.nan_to_num(0.0).sum(1), torch.zeros_like(s[:, 0]))
    target = target / target.sum(-1, keepdim=True).clamp_min(torch.finfo(target.dtype).tiny)
    scores = torch.einsum("qhd,qkd->qhk", qi, ki[safe])
    logits = (torch.relu(scores) * w.unsqueeze(-1)).sum(1).masked_fill(~keep, float("-inf"))
    log_y = torch.log_softmax(logits, -1)
    # a row with no pick adds 0: summed whole, no boolean index (a host read the real op
    # does not make)
    terms = torch.where(keep & (target > 0), target * (torch.log(target.clamp_min(1e-38)) - log_y),
                        torch.zeros_like(target))
    return terms.sum()


def npu_sparse_lightning_indexer_grad_kl_loss(query, key, query_index, key_index, weights, sparse_indices,
                                              softmax_max, softmax_sum, scale_value, *, query_rope=None,
                                              key_rope=None, actual_seq_qlen=None, actual_seq_klen=None,
                                              layout="BSND", sparse_mode=3, pre_tokens=INT64_MAX,
                                              next_tokens=INT64_MAX):
    _check_kl(query, key, query_index, key_index, weights, sparse_indices, softmax_max, softmax_sum,
              query_rope, key_rope, layout, sparse_mode)
    op = "npu_sparse_lightning_indexer_grad_kl_loss"
    math = _math_dtype(query.dtype)
    with torch.enable_grad():
        leaves = [_tokens(x, layout).detach().to(math).requires_grad_() for x in (query_index, key_index, weights)]
        qi, ki, w = leaves
        q, k = (_tokens(x, layout).detach().to(math) for x in (query, key))
        qr, kr = ((None, None) if query_rope is None
                  else (_tokens(x, layout).detach().to(math) for x in (query_rope, key_rope)))
        idx = _tokens(sparse_indices, layout)[:, 0]
        smax, ssum = (x[:, 0].reshape(-1, x.shape[-1]) if layout == "BSND" else x[0] for x in (softmax_max,
                                                                                               softmax_sum))
        n_batch = query.shape[0] if layout == "BSND" else 0
        s_q = query.shape[1] if layout == "BSND" else query.shape[0]
        s_k = key.shape[1] if layout == "BSND" else key.shape[0]
        spans = _spans(op, layout, n_batch, s_q, s_k, actual_seq_qlen, actual_seq_klen, int32_lengths=False)
        loss = qi.sum() * 0
        for (q0, lq), (k0, lk) in spans:
            if lq == 0:
                continue
            _check_selection(op, idx[q0:q0 + lq], lk)
            rows, keys = slice(q0, q0 + lq), slice(k0, k0 + lk)
            loss = loss + _kl_sequence(q[rows], None if qr is None else qr[rows], k[keys, 0],
                                       None if kr is None else kr[keys, 0], qi[rows], ki[keys, 0], w[rows],
                                       idx[rows], smax[rows].to(math), ssum[rows].to(math), scale_value,
                                       _visible(sparse_mode, lq, lk, q.device))
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    d_qi, d_ki, d_w = (torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves))
    return (d_qi.reshape(query_index.shape).to(query_index.dtype),
            d_ki.reshape(key_index.shape).to(key_index.dtype),
            d_w.reshape(weights.shape).to(weights.dtype),
            loss.detach().float().reshape(1))


OPS = {
    "npu_lightning_indexer": npu_lightning_indexer,
    "npu_sparse_flash_attention": npu_sparse_flash_attention,
    "npu_sparse_lightning_indexer_grad_kl_loss": npu_sparse_lightning_indexer_grad_kl_loss,
}

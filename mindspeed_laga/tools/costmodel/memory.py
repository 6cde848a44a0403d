"""Activation bytes autograd keeps for backward inside the attention call.

One named term per tensor *storage* (a view keeps its whole storage alive,
so storages are counted once; ``kv_up_weight`` is a parameter and is
excluded). Written from what this implementation saves, kernel kind by kernel
kind (``config.MODEL_KERNELS``), and checked against ``saved_tensors_hooks``
measurements (tests/tools/test_costmodel.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from ..runspec import RunSpec
from .config import HALF, INDEX_BYTES, NPU_MASK_BYTES, RECOMPUTING_KINDS, Config
from .geometry import key_ranges, query_segments, rebuilt_keys


@dataclass(frozen=True)
class Term:
    """One saved storage (or one per-segment family of them)."""

    name: str
    tensor: str
    bytes: int


class _Saved:
    """Saved storages by key: a storage reached twice is counted once."""

    def __init__(self):
        self.terms: Dict[str, Term] = {}

    def add(self, key: str, tensor: str, nbytes: int, name: Optional[str] = None):
        if nbytes and key not in self.terms:
            self.terms[key] = Term(name or key, tensor, int(nbytes))

    def per_segment(self, key: str, tensor: str, sizes: List[int]):
        """A tensor the kernel makes per query segment (one storage each)."""
        total = sum(sizes)
        if total:
            suffix = f" x {len(sizes)} segments" if len(sizes) > 1 else ""
            self.add(key, tensor + suffix, total)


@dataclass(frozen=True)
class _Operand:
    """A kernel operand: the storage it is a view of."""

    key: str
    tensor: str
    bytes: int


# ---------------------------------------------------------------- what the kernels keep

def _kernel_saved(saved: _Saved, kind: str, cfg: Config, segs, h: int, qk_dim: int, v_dim: int,
                  q: _Operand, k: _Operand, v: _Operand, kv_heads: int):
    """Add what kernels/<kind> keeps for backward, per query segment ``(q_len, key_end)``."""
    b, e = cfg.micro_batch, cfg.elem
    half = cfg.dtype in HALF
    c = 4 if half else e  # compute dtype of scores/softmax: float32 for half inputs
    # A K/V shared by all heads (absorbed) is broadcast with expand(); matmul's batch
    # reshape copies it unless b == 1 (then the reshape is a stride-0 view).
    copied = kv_heads < h and b > 1
    documents = cfg.documents is not None
    segs = [(q.length, q.keys) for q in segs]  # (queries, keys of the kernel call's window)
    ql = [n for n, _ in segs]
    scores = [b * h * n * end for n, end in segs]
    if kind == "eager":
        if half:  # q.to(float32), k.to(float32) per segment (a broadcast K is materialized)
            saved.per_segment("q_fp32", f"float32 copy of q [b, {h}, s_q, {qk_dim}]",
                              [b * h * n * qk_dim * 4 for n in ql])
            saved.per_segment("k_fp32", f"float32 copy of K [b, {h}, key_end, {qk_dim}]",
                              [b * h * end * qk_dim * 4 for _, end in segs])
        else:
            saved.add(q.key, q.tensor, q.bytes)
            if copied:
                saved.per_segment("k_expanded", f"K broadcast to {h} heads, copied by matmul",
                                  [b * h * end * qk_dim * e for _, end in segs])
            else:
                saved.add(k.key, k.tensor, k.bytes)
        if cfg.causal or documents:  # documents: the pieces' block-diagonal keep-mask
            saved.per_segment("causal_mask", "bool keep-mask [s_q, key_end]",
                              [n * end for n, end in segs])
        saved.per_segment("probs", f"softmax output [b, {h}, s_q, key_end] ({'float32' if half else cfg.dtype})",
                          [x * c for x in scores])
        if half:
            saved.per_segment("probs_cast", f"softmax output cast to {cfg.dtype}", [x * e for x in scores])
        if copied:
            saved.per_segment("v_expanded", f"V broadcast to {h} heads, copied by matmul",
                              [b * h * end * v_dim * e for _, end in segs])
        else:
            saved.add(v.key, v.tensor, v.bytes)
    elif kind == "sdpa_math":
        saved.per_segment("q_scaled", "q * sqrt(scale) (SDPA math, compute dtype)",
                          [b * h * n * qk_dim * c for n in ql])
        saved.per_segment("k_scaled", "K * sqrt(scale) (SDPA math, compute dtype)",
                          [b * h * end * qk_dim * c for _, end in segs])
        saved.per_segment("probs", "softmax output (SDPA math, compute dtype)", [x * c for x in scores])
        if half:
            saved.per_segment("v_fp32", "float32 copy of V (SDPA math upcast)",
                              [b * h * end * v_dim * 4 for _, end in segs])
        elif copied:
            saved.per_segment("v_expanded", f"V broadcast to {h} heads, copied by matmul",
                              [b * h * end * v_dim * e for _, end in segs])
        else:
            saved.add(v.key, v.tensor, v.bytes)
    elif kind in ("fused", "sdpa_flash", "npu"):
        saved.add(q.key, q.tensor, q.bytes)
        saved.add(k.key, k.tensor, k.bytes)
        saved.add(v.key, v.tensor, v.bytes)
        saved.per_segment("attn_out", f"attention output [b, {h}, s_q, {v_dim}]",
                          [b * h * n * v_dim * e for n in ql])
        if kind in ("fused", "sdpa_flash"):
            saved.per_segment("lse", "float32 log-sum-exp [b, h, s_q]", [b * h * n * 4 for n in ql])
            if kind == "sdpa_flash" and (cfg.causal or documents):
                # the float mask CPU SDPA builds from ours: bottom-right causal segments,
                # and with documents every segment's block-diagonal keep-mask
                saved.per_segment("sdpa_mask", "float attn_mask [s_q, key_end] (CPU SDPA)",
                                  [n * end * e for n, end in segs if n != end or documents])
        else:
            saved.per_segment("softmax_max", "float32 softmax max [b, h, s_q, 8]",
                              [b * h * n * 8 * 4 for n in ql])
            saved.per_segment("softmax_sum", "float32 softmax sum [b, h, s_q, 8]",
                              [b * h * n * 8 * 4 for n in ql])
            if cfg.causal:
                saved.add("npu_mask", "compressed causal mask 2048x2048 bool (cached, shared "
                          "by every layer)", NPU_MASK_BYTES)
    else:
        raise ValueError(f"kernel kind {kind!r} has no saved-tensor model")


# ---------------------------------------------------------------- per-form saved sets

def _query(cfg: Config, width: int, name: str = "query") -> _Operand:
    """The kernel's q: the input (allgather, no CP) or the all-to-all output (ulysses)."""
    z = cfg.sizes
    e, b, s, S, n, h = z.elem, z.batch, z.local_len, z.seq_len, z.tp_heads, z.heads
    if cfg.heads_split:
        return _Operand(f"{name}_a2a", f"{name} after all-to-all [{cfg.algo.split_rows_label}, b, {h}, {width}]",
                        cfg.query_len * b * h * width * e)
    return _Operand(name, f"{name} [s, b, {n}, {width}]", s * b * n * width * e)


def _gathered_latent(cfg: Config, fresh_without_cp: bool) -> _Operand:
    z = cfg.sizes
    d, e, b, s, S = z.dims, z.elem, z.batch, z.local_len, z.seq_len
    if cfg.cp_size == 1:
        if fresh_without_cp:
            return _Operand("latent", "[kv_latent, k_pos_emb] [s, b, d_c+d_r] (concatenated)",
                            s * b * d.latent_dim * e)
        return _Operand("kv_latent", "kv_latent [s, b, d_c] (input)", s * b * d.kv_lora_rank * e)
    return _Operand("latent", "gathered latent [S, b, d_c+d_r], position order (the whole "
                    "storage, also when trimmed: the trimmed keys are a view)", S * b * d.latent_dim * e)


def _add_index(saved: _Saved, cfg: Config):
    if cfg.reorders:
        saved.add("position_index", "int64 [S] permutation to position order (index_select; "
                  "cached, shared by every layer)", cfg.seq_len * INDEX_BYTES)


def _explicit_saved(cfg: Config, rank: int, kind: str) -> _Saved:
    z = cfg.sizes
    d, e, b, s, S, n, h = z.dims, z.elem, z.batch, z.local_len, z.seq_len, z.tp_heads, z.heads
    saved = _Saved()
    saved.add("kv_latent", "kv_latent [s, b, d_c] (input of linear_kv_up_proj)", s * b * d.kv_lora_rank * e)
    q = _query(cfg, d.qk_dim)
    if cfg.cp_size == 1:  # no gather: the up-projection's K and V are attended directly
        k = _Operand("key", f"key [s, b, {n}, d_n+d_r] (k_nope and rope key concatenated)",
                     s * b * n * d.qk_dim * e)
        v = _Operand("value", f"value [s, b, {n}, d_v] (own storage)", s * b * n * d.v_head_dim * e)
    else:
        how = "all-to-all" if cfg.heads_split else "all-gather"
        k = _Operand("key", f"key after {how} [S, b, {h}, d_n+d_r]", S * b * h * d.qk_dim * e)
        v = _Operand("value", f"value after {how} [S, b, {h}, d_v]", S * b * h * d.v_head_dim * e)
    _add_index(saved, cfg)
    _kernel_saved(saved, kind, cfg, query_segments(cfg, rank), h, d.qk_dim, d.v_head_dim, q, k, v, h)
    return saved


def _laga_saved(cfg: Config, rank: int, kind: str, v: RunSpec) -> _Saved:
    z = cfg.sizes
    d, e, b, s, S, h = z.dims, z.elem, z.batch, z.local_len, z.seq_len, z.heads
    saved = _Saved()
    q = _query(cfg, d.qk_dim)
    # Trimming to several key ranges (documents) copies the kept rows (forms/common.take_ranges):
    # the copy is saved instead of the gathered latent.
    copied = v.trim_causal_prefix and len(key_ranges(cfg, rank)) > 1
    keys = rebuilt_keys(cfg, rank, v)
    if v.recompute_kv:  # BlockwiseLAGA saves q, the gathered latent, the output and the lse
        lat = _gathered_latent(cfg, fresh_without_cp=True)
        if copied:
            lat = _Operand("latent", "trimmed latent [S_vis, b, d_c+d_r] (the key ranges, copied)",
                           keys * b * d.latent_dim * e)
        s_q = cfg.query_len
        saved.add(q.key, q.tensor, q.bytes)
        saved.add(lat.key, lat.tensor, lat.bytes)
        saved.add("attn_out", f"attention output [b, {h}, s_q, d_v]", b * h * s_q * d.v_head_dim * e)
        saved.add("lse", f"float32 log-sum-exp [b, {h}, s_q]", b * h * s_q * 4)
        _add_index(saved, cfg)
        return saved
    lat = _gathered_latent(cfg, fresh_without_cp=False)
    if copied:
        lat = _Operand("kv_latent_trimmed", "trimmed kv_latent [S_vis, b, d_c] (the key ranges, copied)",
                       keys * b * d.kv_lora_rank * e)
    saved.add(lat.key, lat.tensor, lat.bytes)  # input of linear_kv_up_proj
    key = _Operand("key", f"rebuilt key [{'S_vis' if v.trim_causal_prefix else 'S'}, b, {h}, d_n+d_r]",
                   keys * b * h * d.qk_dim * e)
    # V gets its own storage (forms/common.up_project), so the up-projection output is freed.
    value = _Operand("value", f"rebuilt value [{'S_vis' if v.trim_causal_prefix else 'S'}, b, {h}, d_v]",
                     keys * b * h * d.v_head_dim * e)
    _add_index(saved, cfg)
    _kernel_saved(saved, kind, cfg, query_segments(cfg, rank), h, d.qk_dim, d.v_head_dim, q, key, value, h)
    return saved


def _absorbed_saved(cfg: Config, rank: int, kind: str) -> _Saved:
    z = cfg.sizes
    d, e, b, s, S, n, h = z.dims, z.elem, z.batch, z.local_len, z.seq_len, z.tp_heads, z.heads
    saved = _Saved()
    saved.add("query", f"query [s, b, {n}, d_n+d_r] (q_nope . W_UK keeps it)", s * b * n * d.qk_dim * e)
    q_abs = _query(cfg, d.latent_dim, "q_abs")
    keys = S if cfg.cp_size > 1 else s
    key = _Operand("latent_key", "latent key [S, b, 1, d_c+d_r] (concatenated)", keys * b * d.latent_dim * e)
    value = _gathered_latent(cfg, fresh_without_cp=False)  # V is the latent's kv part (a view)
    _add_index(saved, cfg)
    segs = query_segments(cfg, rank)
    _kernel_saved(saved, kind, cfg, segs, h, d.latent_dim, d.kv_lora_rank, q_abs, key, value, 1)
    s_q = cfg.query_len
    # o_latent . W_UV per segment (einsum): a copy [h, b*s_q, d_c] unless b == 1 (then
    # a view of the attention output, which a fused kernel keeps anyway).
    shares = b == 1 and kind in RECOMPUTING_KINDS
    saved.add("attn_out" if shares else "o_latent", f"latent-space output [b, {h}, s_q, d_c] "
              "(input of o_latent . W_UV)", b * h * s_q * d.kv_lora_rank * e,
              name="o_latent" if not shares else None)
    return saved


def saved_terms(cfg: Config, rank: int, kind: str, spec: RunSpec) -> List[Term]:
    """What ``spec`` keeps for backward at rank ``rank`` with kernel kind ``kind``."""
    if spec.form == "explicit":
        saved = _explicit_saved(cfg, rank, kind)
    elif spec.form == "absorbed":
        saved = _absorbed_saved(cfg, rank, kind)
    else:
        saved = _laga_saved(cfg, rank, kind, spec)
    return list(saved.terms.values())

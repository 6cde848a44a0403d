"""Cost model: what each MLA form moves, keeps and computes, per layer and per CP rank.

Pure Python (no torch). For MLA dims, sequence length S, micro-batch b, CP
size P, TP size, cp_algo, dtype and attention kernel it gives, for explicit,
absorbed, LAGA and LAGA's options (issue 5), forward and backward:

- ``comm``: every collective with the byte counter's two measures
  (``payload`` = this rank's sequence-sharded tensor handed to the
  collective; ``wire`` = the bytes this rank sends: ring all-gather /
  reduce-scatter ``(P-1) * payload``, all-to-all ``payload * (P-1)/P``) and
  DESIGN.md section 2's ``payload * (P-1)/P``. Equal to ``comm.count_bytes``
  exactly (tests/test_costmodel.py).
- ``saved``: activation bytes autograd keeps for backward inside the
  attention call, one named term per tensor *storage* (a view keeps its whole
  storage alive, so storages are counted once; ``kv_up_weight`` is a
  parameter and is excluded). Written from what *this* implementation saves,
  kernel by kernel, and checked against ``saved_tensors_hooks`` measurements.
- ``flops``: attention (Q.K^T and P.V; ``executed`` = the rectangles our
  segment recipe runs, masked keys included, which is what
  ``FlopCounterMode`` counts; ``visible`` = causal pairs only, the floor of a
  causal fused kernel) and the K/V up-projection ("rebuild"; for absorbed the
  q.W_UK and o_latent.W_UV products that replace it).

Kernels (``Config.kernel``):

- ``eager``: kernels/eager.py; the score matrix is materialized and kept.
- ``fused``: a flash-style kernel (no score matrix): q, K, V, the output and
  a float32 log-sum-exp per query row are kept; causal masking is in-kernel.
- ``npu``: ``npu_fusion_attention``: as ``fused`` but the softmax max and sum
  are [b, h, s_q, 8] float32 each, plus the shared 2048x2048 compressed mask.
- ``sdpa``: torch SDPA *on CPU*: kernels/sdpa.py calls the CPU flash op
  for every head dims and causal alignment, keeping what ``fused`` keeps
  (``sdpa_flash`` and ``sdpa_math`` describe SDPA's own CPU paths: flash plus
  the float attn_mask of bottom-right causal segments, and the math fallback
  with the probabilities kept).

Recomputing LAGA (``recompute_kv``) runs its own blockwise kernels; its saved
set does not depend on the kernel.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional, Tuple

FORMS = ("explicit", "absorbed", "laga")
CP_ALGOS = ("allgather", "ulysses")
LAYOUTS = ("zigzag", "contiguous")
KERNELS = ("eager", "fused", "npu", "sdpa", "sdpa_flash", "sdpa_math")
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
HALF = ("bfloat16", "float16")
DEFAULT_LAYOUT = {"allgather": "zigzag", "ulysses": "contiguous"}
NPU_MASK_BYTES = 2048 * 2048  # the compressed causal mask (bool), cached and shared
INDEX_BYTES = 8               # int64 position-order index


@dataclass(frozen=True)
class MLADims:
    """MLA sizes of the whole model (heads before TP)."""

    heads: int
    qk_head_dim: int
    rope_dim: int
    v_head_dim: int
    kv_lora_rank: int
    hidden_size: Optional[int] = None   # only for the query-projection (overlap) estimate
    q_lora_rank: Optional[int] = None

    @property
    def qk_dim(self) -> int:
        return self.qk_head_dim + self.rope_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim


PRESETS = {
    # config.json of deepseek-ai/DeepSeek-V3 (and DESIGN.md section 5's pretrain flags)
    "deepseek-v3": MLADims(heads=128, qk_head_dim=128, rope_dim=64, v_head_dim=128,
                           kv_lora_rank=512, hidden_size=7168, q_lora_rank=1536),
    # config.json of deepseek-ai/DeepSeek-V2-Lite: no q_lora (q_proj straight from hidden)
    "deepseek-v2-lite": MLADims(heads=16, qk_head_dim=128, rope_dim=64, v_head_dim=128,
                                kv_lora_rank=512, hidden_size=2048, q_lora_rank=None),
}


def preset(name: str) -> MLADims:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; use one of {sorted(PRESETS)} or give the dims")
    return PRESETS[name]


@dataclass(frozen=True)
class Variant:
    """A form plus LAGA's options (the keywords of ``laga_attention``)."""

    name: str
    form: str
    trim: bool = False          # trim_causal_prefix
    recompute: bool = False     # recompute_kv
    block_size: Optional[int] = None  # kv_block_size (with recompute); None = one block
    overlap: bool = False       # latent_gather started before the query projection

    def options(self) -> dict:
        opts = {}
        if self.trim:
            opts["trim_causal_prefix"] = True
        if self.recompute:
            opts["recompute_kv"] = True
        if self.block_size:
            opts["kv_block_size"] = self.block_size
        return opts


def standard_variants(block_size: Optional[int] = None) -> List[Variant]:
    """The three forms and LAGA's options, in table order."""
    out = [Variant("explicit", "explicit"), Variant("absorbed", "absorbed"), Variant("laga", "laga"),
           Variant("laga+trim", "laga", trim=True),
           Variant("laga+recompute", "laga", recompute=True)]
    if block_size:
        out += [Variant("laga+blockwise", "laga", recompute=True, block_size=block_size),
                Variant("laga+blockwise+trim", "laga", trim=True, recompute=True,
                        block_size=block_size)]
    out.append(Variant("laga+overlap", "laga", overlap=True))
    return out


@dataclass(frozen=True)
class Config:
    dims: MLADims
    seq_len: int
    micro_batch: int = 1
    cp_size: int = 1
    tp_size: int = 1
    cp_algo: str = "ulysses"
    layout: Optional[str] = None   # None: zigzag for allgather, contiguous for ulysses
    dtype: str = "bfloat16"
    kernel: str = "fused"
    causal: bool = True

    @property
    def elem(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def local_len(self) -> int:
        return self.seq_len // self.cp_size

    @property
    def tp_heads(self) -> int:
        """Heads on this TP rank (n/TP): the rows of kv_up_weight it holds."""
        return self.dims.heads // self.tp_size

    @property
    def heads_split(self) -> bool:
        return self.cp_algo == "ulysses" and self.cp_size > 1

    @property
    def attended_heads(self) -> int:
        """Heads this rank attends: n/TP (allgather) or n/(TP*P) (ulysses)."""
        return self.tp_heads // self.cp_size if self.heads_split else self.tp_heads

    @property
    def seq_layout(self) -> str:
        return self.layout or DEFAULT_LAYOUT[self.cp_algo]

    @property
    def reorders(self) -> bool:
        """A rank-order gather is permuted to position order (index_select)."""
        return self.cp_size > 1 and self.seq_layout == "zigzag"


def validate(cfg: Config, variants: Optional[List[Variant]] = None) -> None:
    """ValueError naming the setting and the fix for anything the forms would reject."""
    d = cfg.dims
    for name, value in (("heads", d.heads), ("qk_head_dim", d.qk_head_dim),
                        ("qk_pos_emb_head_dim", d.rope_dim), ("v_head_dim", d.v_head_dim),
                        ("kv_lora_rank", d.kv_lora_rank), ("seq_len", cfg.seq_len),
                        ("micro_batch", cfg.micro_batch), ("cp_size", cfg.cp_size),
                        ("tp_size", cfg.tp_size)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    for name, value in (("hidden_size", d.hidden_size), ("q_lora_rank", d.q_lora_rank)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if cfg.cp_algo not in CP_ALGOS:
        raise ValueError(f"cp_algo={cfg.cp_algo!r} is unknown; use one of {CP_ALGOS}")
    if cfg.seq_layout not in LAYOUTS:
        raise ValueError(f"layout={cfg.layout!r} is unknown; use one of {LAYOUTS}")
    if cfg.dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={cfg.dtype!r} is unknown; use one of {tuple(DTYPE_BYTES)}")
    if cfg.kernel not in KERNELS:
        raise ValueError(f"kernel={cfg.kernel!r} is unknown; use one of {KERNELS}")
    if d.heads % cfg.tp_size:
        raise ValueError(f"heads={d.heads} is not divisible by TP={cfg.tp_size}; "
                         "use a TP size that divides the heads")
    chunks = 2 * cfg.cp_size if cfg.seq_layout == "zigzag" and cfg.cp_size > 1 else cfg.cp_size
    if cfg.seq_len % chunks:
        raise ValueError(f"sequence length {cfg.seq_len} is not divisible by {chunks} "
                         f"({'2*CP' if chunks != cfg.cp_size else 'CP'} for layout="
                         f"{cfg.seq_layout!r}, CP={cfg.cp_size}); pad it to a multiple of {chunks}")
    if cfg.cp_algo == "ulysses" and cfg.tp_heads % cfg.cp_size:
        raise ValueError(f"cp_algo='ulysses' splits the {cfg.tp_heads} heads per TP rank over "
                         f"CP={cfg.cp_size}: not divisible; use cp_algo='allgather' or a CP size "
                         "dividing heads/TP")
    for v in variants or ():
        if v.block_size is not None and v.block_size <= 0:
            raise ValueError(f"kv_block_size must be positive, got {v.block_size}")


# ---------------------------------------------------------------- segments (as layout.py)

def _rank_segments(cfg: Config, rank: int) -> List[Tuple[int, int]]:
    """(length, global_start) of the consecutive-position runs rank ``rank`` holds."""
    s, P = cfg.local_len, cfg.cp_size
    if P == 1:
        return [(s, 0)]
    if cfg.seq_layout == "contiguous":
        return [(s, rank * s)]
    c = s // 2
    return [(c, rank * c), (c, (2 * P - 1 - rank) * c)]


def query_segments(cfg: Config, rank: int) -> List[Tuple[int, int, int]]:
    """(query length, global start, key prefix end) per segment the kernel is called on."""
    if cfg.heads_split:  # ulysses: every rank's tokens, in rank order
        segs = [seg for r in range(cfg.cp_size) for seg in _rank_segments(cfg, r)]
    else:
        segs = _rank_segments(cfg, rank)
    return [(n, g, g + n if cfg.causal else cfg.seq_len) for n, g in segs]


def visible_keys(cfg: Config, rank: int) -> int:
    """Keys [0, end) some query of this rank sees: what prefix trimming rebuilds."""
    return max(end for _, _, end in query_segments(cfg, rank))


def key_blocks(cfg: Config, rank: int, v: Variant) -> List[Tuple[int, int]]:
    """The K/V blocks the recomputing LAGA rebuilds (forms/laga_blockwise.blocks)."""
    last = visible_keys(cfg, rank) if v.trim else cfg.seq_len
    size = v.block_size or last
    return [(k0, min(k0 + size, last)) for k0 in range(0, last, size)]


def resolve_kernel(kernel: str, qk_dim: int, v_dim: int) -> str:
    """``sdpa`` on CPU runs the flash op for any head dims (kernels/sdpa.py): ``fused``."""
    return "fused" if kernel == "sdpa" else kernel


# ---------------------------------------------------------------- results

@dataclass
class Term:
    """One saved storage (or one per-segment family of them)."""

    name: str
    tensor: str
    bytes: int


@dataclass
class Collective:
    kind: str
    direction: str
    tag: str
    payload: int
    wire: int
    design: float


@dataclass
class FormCost:
    variant: str
    form: str
    rank: int
    kernel: str                      # the resolved kernel kind
    comm: List[Collective]
    saved: List[Term]
    flops: Dict[str, int]
    kv_transient_bytes: int = 0      # K/V a recomputing LAGA holds at once (not saved)

    def comm_bytes(self, direction: Optional[str] = None, measure: str = "payload") -> float:
        return sum(getattr(c, measure) for c in self.comm
                   if direction is None or c.direction == direction)

    @property
    def saved_bytes(self) -> int:
        return sum(t.bytes for t in self.saved)


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
    segs = [(n, end) for n, _, end in segs]
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
        if cfg.causal:
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
            if cfg.causal and kind == "sdpa_flash":  # the float mask CPU SDPA builds from ours
                saved.per_segment("sdpa_mask", "float attn_mask [s_q, key_end] of bottom-right "
                                  "causal segments (CPU SDPA)",
                                  [n * end * e for n, end in segs if n != end])
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

def _common(cfg: Config):
    d, e, b = cfg.dims, cfg.elem, cfg.micro_batch
    return d, e, b, cfg.local_len, cfg.seq_len, cfg.tp_heads, cfg.attended_heads


def _query(cfg: Config, width: int, name: str = "query") -> _Operand:
    """The kernel's q: the input (allgather, no CP) or the all-to-all output (ulysses)."""
    d, e, b, s, S, n, h = _common(cfg)
    if cfg.heads_split:
        return _Operand(f"{name}_a2a", f"{name} after all-to-all [S, b, {h}, {width}]", S * b * h * width * e)
    return _Operand(name, f"{name} [s, b, {n}, {width}]", s * b * n * width * e)


def _gathered_latent(cfg: Config, fresh_without_cp: bool) -> _Operand:
    d, e, b, s, S, n, h = _common(cfg)
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
    d, e, b, s, S, n, h = _common(cfg)
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


def _laga_saved(cfg: Config, rank: int, kind: str, v: Variant) -> _Saved:
    d, e, b, s, S, n, h = _common(cfg)
    saved = _Saved()
    q = _query(cfg, d.qk_dim)
    if v.recompute:  # BlockwiseLAGA saves q, the gathered latent, the output and the lse
        lat = _gathered_latent(cfg, fresh_without_cp=True)
        s_q = S if cfg.heads_split else s
        saved.add(q.key, q.tensor, q.bytes)
        saved.add(lat.key, lat.tensor, lat.bytes)
        saved.add("attn_out", f"attention output [b, {h}, s_q, d_v]", b * h * s_q * d.v_head_dim * e)
        saved.add("lse", f"float32 log-sum-exp [b, {h}, s_q]", b * h * s_q * 4)
        _add_index(saved, cfg)
        return saved
    keys = visible_keys(cfg, rank) if v.trim else S
    lat = _gathered_latent(cfg, fresh_without_cp=False)
    saved.add(lat.key, lat.tensor, lat.bytes)  # input of linear_kv_up_proj
    key = _Operand("key", f"rebuilt key [{'S_vis' if v.trim else 'S'}, b, {h}, d_n+d_r]",
                   keys * b * h * d.qk_dim * e)
    # V gets its own storage (forms/common.up_project), so the up-projection output is freed.
    value = _Operand("value", f"rebuilt value [{'S_vis' if v.trim else 'S'}, b, {h}, d_v]",
                     keys * b * h * d.v_head_dim * e)
    _add_index(saved, cfg)
    _kernel_saved(saved, kind, cfg, query_segments(cfg, rank), h, d.qk_dim, d.v_head_dim, q, key, value, h)
    return saved


def _absorbed_saved(cfg: Config, rank: int, kind: str) -> _Saved:
    d, e, b, s, S, n, h = _common(cfg)
    saved = _Saved()
    saved.add("query", f"query [s, b, {n}, d_n+d_r] (q_nope . W_UK keeps it)", s * b * n * d.qk_dim * e)
    q_abs = _query(cfg, d.latent_dim, "q_abs")
    keys = S if cfg.cp_size > 1 else s
    key = _Operand("latent_key", "latent key [S, b, 1, d_c+d_r] (concatenated)", keys * b * d.latent_dim * e)
    value = _gathered_latent(cfg, fresh_without_cp=False)  # V is the latent's kv part (a view)
    _add_index(saved, cfg)
    segs = query_segments(cfg, rank)
    _kernel_saved(saved, kind, cfg, segs, h, d.latent_dim, d.kv_lora_rank, q_abs, key, value, 1)
    s_q = S if cfg.heads_split else s
    # o_latent . W_UV per segment (einsum): a copy [h, b*s_q, d_c] unless b == 1 (then
    # a view of the attention output, which a fused kernel keeps anyway).
    shares = b == 1 and kind in ("fused", "sdpa_flash", "npu")
    saved.add("attn_out" if shares else "o_latent", f"latent-space output [b, {h}, s_q, d_c] "
              "(input of o_latent . W_UV)", b * h * s_q * d.kv_lora_rank * e,
              name="o_latent" if not shares else None)
    return saved


# ---------------------------------------------------------------- FLOPs

def _matmul_flops(pairs: int, b: int, h: int, qk_dim: int, v_dim: int) -> Tuple[int, int, int]:
    """FLOPs over ``pairs`` (query, key) pairs: forward Q.K^T + P.V; backward of a kernel
    that keeps the scores (dQ, dK: qk; dP, dV: v) and of one that recomputes them first
    (flash-style: Q.K^T again, then dP, dV, dQ, dK)."""
    unit = 2 * b * h * pairs
    return unit * (qk_dim + v_dim), unit * 2 * (qk_dim + v_dim), unit * (3 * qk_dim + 2 * v_dim)


def _attention(cfg: Config, rank: int, kind: str, v: Variant, qk_dim: int, v_dim: int) -> Dict[str, int]:
    """Attention FLOPs as executed (rectangles, masked keys included) and causal-visible."""
    b, h = cfg.micro_batch, cfg.attended_heads
    segs = query_segments(cfg, rank)
    visible = sum(n * (end - n) + n * (n + 1) // 2 if cfg.causal else n * end for n, _, end in segs)
    if v.recompute:  # blockwise: rows before the block and keys after the segment are cut
        pairs = 0          # (laga_blockwise.visible_rows)
        for k0, k1 in key_blocks(cfg, rank, v):
            for n, g, _ in segs:
                first = max(0, k0 - g) if cfg.causal else 0
                end = min(k1, g + n) if cfg.causal else k1
                pairs += max(0, n - first) * max(0, end - k0)
    else:
        pairs = sum(n * end for n, _, end in segs)
    fwd, bwd_kept, bwd_recomputed = _matmul_flops(pairs, b, h, qk_dim, v_dim)
    recomputes = v.recompute or kind in ("fused", "sdpa_flash", "npu")
    return {"attention_fwd": fwd, "attention_bwd": bwd_recomputed if recomputes else bwd_kept,
            "attention_visible_fwd": _matmul_flops(visible, b, h, qk_dim, v_dim)[0]}


def _flops(cfg: Config, rank: int, kind: str, v: Variant) -> Dict[str, int]:
    d, e, b, s, S, n, h = _common(cfg)
    kv_rows = d.qk_head_dim + d.v_head_dim
    if v.form == "absorbed":
        flops = _attention(cfg, rank, kind, v, d.latent_dim, d.kv_lora_rank)
        s_q = S if cfg.heads_split else s
        # q_nope . W_UK on every local head (before the all-to-all), o_latent . W_UV
        rebuild = 2 * s * b * n * d.qk_head_dim * d.kv_lora_rank + 2 * s_q * b * h * d.kv_lora_rank * d.v_head_dim
        rebuild_bwd = 2 * rebuild
    else:
        flops = _attention(cfg, rank, kind, v, d.qk_dim, d.v_head_dim)
        if v.form == "explicit":  # local latent -> K/V of every local head
            rebuild = 2 * s * b * d.kv_lora_rank * n * kv_rows
        elif v.recompute:
            rebuild = sum(k1 - k0 for k0, k1 in key_blocks(cfg, rank, v)) * 2 * b * d.kv_lora_rank * h * kv_rows
        else:  # gathered latent -> K/V of every (visible) key, this rank's heads
            keys = visible_keys(cfg, rank) if v.trim else S
            rebuild = keys * 2 * b * d.kv_lora_rank * h * kv_rows
        # recompute: rebuilt again in backward, then dK/dV -> d(latent), d(kv_up_weight)
        rebuild_bwd = (3 if v.recompute else 2) * rebuild
    flops.update(rebuild_fwd=rebuild, rebuild_bwd=rebuild_bwd)
    return flops


def query_projection_flops(cfg: Config) -> Optional[int]:
    """Forward FLOPs of this rank's query projection (the window the latent gather can hide in)."""
    d = cfg.dims
    width = d.q_lora_rank or d.hidden_size
    if width is None:
        return None
    return 2 * cfg.local_len * cfg.micro_batch * width * cfg.tp_heads * d.qk_dim


# ---------------------------------------------------------------- communication

def _collectives(cfg: Config, form: str) -> List[Collective]:
    d, e, b, s, S, n, h = _common(cfg)
    P = cfg.cp_size
    if P == 1:
        return []
    tokens = s * b
    if form == "explicit" and not cfg.heads_split:
        parts = [("all_gather", "key", n * d.qk_dim), ("all_gather", "value", n * d.v_head_dim)]
    elif form == "explicit":
        parts = [("all_to_all", "query", n * d.qk_dim), ("all_to_all", "key", n * d.qk_dim),
                 ("all_to_all", "value", n * d.v_head_dim), ("all_to_all", "output", n * d.v_head_dim)]
    elif not cfg.heads_split:
        parts = [("all_gather", "latent", d.latent_dim)]
    else:
        q_width = d.latent_dim if form == "absorbed" else d.qk_dim
        parts = [("all_to_all", "query", n * q_width), ("all_gather", "latent", d.latent_dim),
                 ("all_to_all", "output", n * d.v_head_dim)]
    out = []
    for direction in ("forward", "backward"):
        for kind, tag, width in parts:
            if direction == "backward" and kind == "all_gather":
                kind = "reduce_scatter"
            payload = tokens * width * e
            wire = payload * (P - 1) // P if kind == "all_to_all" else (P - 1) * payload
            out.append(Collective(kind, direction, tag, payload, wire, payload * (P - 1) / P))
    return out


# ---------------------------------------------------------------- entry points

def form_cost(cfg: Config, variant: Variant, rank: int = 0) -> FormCost:
    """Everything about one variant on one CP rank."""
    d = cfg.dims
    qk, vd = (d.latent_dim, d.kv_lora_rank) if variant.form == "absorbed" else (d.qk_dim, d.v_head_dim)
    kind = "blockwise" if variant.recompute else resolve_kernel(cfg.kernel, qk, vd)
    if variant.form == "explicit":
        saved = _explicit_saved(cfg, rank, kind)
    elif variant.form == "absorbed":
        saved = _absorbed_saved(cfg, rank, kind)
    elif variant.form == "laga":
        saved = _laga_saved(cfg, rank, kind, variant)
    else:
        raise ValueError(f"form {variant.form!r} is unknown; use one of {FORMS}")
    transient = 0
    if variant.recompute:
        at_once = max(k1 - k0 for k0, k1 in key_blocks(cfg, rank, variant))
        h = cfg.attended_heads
        transient = at_once * cfg.micro_batch * h * (d.qk_dim + d.qk_head_dim + d.v_head_dim) * cfg.elem
    return FormCost(variant.name, variant.form, rank, kind, _collectives(cfg, variant.form),
                    list(saved.terms.values()), _flops(cfg, rank, kind, variant), transient)


def rank_summary(cfg: Config, variant: Variant) -> dict:
    """Rank 0's costs plus the rank-average and worst rank of saved bytes and FLOPs."""
    costs = [form_cost(cfg, variant, r) for r in range(cfg.cp_size)]
    first = costs[0]
    worst = max(costs, key=lambda c: (c.saved_bytes, sum(c.flops.values())))
    flop_keys = first.flops.keys()
    return {
        "variant": variant.name, "form": variant.form, "kernel": first.kernel,
        "options": variant.options(), "overlap": variant.overlap,
        "comm": {
            "forward": {m: first.comm_bytes("forward", m) for m in ("payload", "wire", "design")},
            "backward": {m: first.comm_bytes("backward", m) for m in ("payload", "wire", "design")},
            "collectives": [asdict(c) for c in first.comm],
        },
        "saved_bytes": {"rank0": first.saved_bytes,
                        "average": sum(c.saved_bytes for c in costs) / len(costs),
                        "worst": max(c.saved_bytes for c in costs), "worst_rank": worst.rank},
        "saved_terms_rank0": [asdict(t) for t in first.saved],
        "flops": {k: {"rank0": first.flops[k], "average": sum(c.flops[k] for c in costs) / len(costs),
                      "worst": max(c.flops[k] for c in costs)} for k in flop_keys},
        "kv_transient_bytes": max(c.kv_transient_bytes for c in costs),
    }


# ---------------------------------------------------------------- time estimate

@dataclass(frozen=True)
class Machine:
    """Per-rank link bandwidth (GB/s, bytes a rank sends) and effective matmul throughput."""

    name: str
    link_gbps: float
    tflops: float


# Assumptions, not measurements (override with --link-bandwidth / --device-tflops):
# 910B bf16 dense peak is about 320 TFLOPS; 160 assumes ~50% utilization by the
# attention matmuls. Intra-node: 7 HCCS links per NPU in the 8-NPU mesh, about
# 28 GB/s each way per link -> ~196 GB/s a rank can send. Cross-node: one
# 200 Gb/s RoCE NIC per NPU -> 25 GB/s.
MACHINES = {
    "910b-intra-node": Machine("910b-intra-node", 196.0, 160.0),
    "910b-cross-node": Machine("910b-cross-node", 25.0, 160.0),
}


def estimate_seconds(cfg: Config, summary: dict, machine: Machine) -> dict:
    """Per-layer fwd+bwd time of the worst rank: compute + wire bytes / bandwidth, serial,
    minus what the overlapped latent gather hides behind the query projection.

    Attention FLOPs: causal-visible pairs for the fused kernel of the non-recomputing
    forms, executed rectangles for the blockwise path."""
    f = summary["flops"]
    attn = f["attention_fwd"]["worst"] + f["attention_bwd"]["worst"]
    if not summary["options"].get("recompute_kv"):
        # A fused causal kernel skips fully masked tiles: count visible pairs. The
        # blockwise path hands each block's full rectangle (explicit mask) to its kernel.
        attn *= f["attention_visible_fwd"]["worst"] / f["attention_fwd"]["worst"]
    flops = attn + f["rebuild_fwd"]["worst"] + f["rebuild_bwd"]["worst"]
    compute = flops / (machine.tflops * 1e12)
    wire = summary["comm"]["forward"]["wire"] + summary["comm"]["backward"]["wire"]
    comm = wire / (machine.link_gbps * 1e9)
    hidden = 0.0
    if summary["overlap"] and cfg.cp_size > 1:
        qproj = query_projection_flops(cfg)
        if qproj:
            window_fwd = qproj / (machine.tflops * 1e12)
            latent = [c for c in summary["comm"]["collectives"] if c["tag"] == "latent"]
            for c in latent:
                hidden += min(c["wire"] / (machine.link_gbps * 1e9),
                              window_fwd if c["direction"] == "forward" else 2 * window_fwd)
    return {"compute_s": compute, "comm_s": comm, "hidden_s": hidden,
            "total_s": compute + comm - hidden}


def config_summary(cfg: Config) -> dict:
    d = cfg.dims
    return {"heads": d.heads, "qk_head_dim": d.qk_head_dim, "qk_pos_emb_head_dim": d.rope_dim,
            "v_head_dim": d.v_head_dim, "kv_lora_rank": d.kv_lora_rank, "hidden_size": d.hidden_size,
            "q_lora_rank": d.q_lora_rank, "seq_len": cfg.seq_len, "micro_batch": cfg.micro_batch,
            "cp_size": cfg.cp_size, "tp_size": cfg.tp_size, "cp_algo": cfg.cp_algo,
            "layout": cfg.seq_layout, "dtype": cfg.dtype, "kernel": cfg.kernel, "causal": cfg.causal}


def with_(cfg: Config, **changes) -> Config:
    return replace(cfg, **changes)

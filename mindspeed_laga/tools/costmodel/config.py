"""What the cost model is asked about: the model's dims, the parallel setup, the
dtype and the attention kernel; presets, the model's kernel kinds, validation."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Iterable, Optional, Sequence, Tuple

from ..runspec import RunSpec
from ...cp_algos import SplitView
from ...vocab.names import ATTN_CP_ALGOS, LAYOUTS
from ...vocab.segments import Documents, check_seq_len
from ...vocab.dims import MLADims, ModelDims
from ...vocab.documents import check_documents
from .presets import PRESETS, preset  # noqa: F401  (the registry is presets.py; asked here too)

# The cost model's kernel kinds: what a kernel keeps for backward and whether it
# recomputes the scores. Not the core's KERNELS (what a caller may ask for).
EAGER = "eager"            # kernels/eager.py: the score matrix is materialized and kept
FUSED = "fused"            # flash-style: q, K, V, output and a float32 lse are kept
NPU = "npu"                # npu_fusion_attention: as fused, softmax max/sum [.., 8] and a mask
SDPA = "sdpa"              # torch SDPA on CPU: resolves to one of the two below per form
SDPA_FLASH = "sdpa_flash"  # its flash kernel (q/k head dim == v head dim)
SDPA_MATH = "sdpa_math"    # its math fallback (scaled copies and probabilities kept)
BLOCKWISE = "blockwise"    # recomputing LAGA's own blockwise kernels (any kernel asked)
MODEL_KERNELS = (EAGER, FUSED, NPU, SDPA, SDPA_FLASH, SDPA_MATH)
# Kinds that recompute the scores in backward (no score matrix kept).
RECOMPUTING_KINDS = (FUSED, SDPA_FLASH, NPU)

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
HALF = ("bfloat16", "float16")
NPU_MASK_BYTES = 2048 * 2048  # the compressed causal mask (bool), cached and shared
INDEX_BYTES = 8               # int64 position-order index

def model_kernel_kind(kernel: str, qk_dim: int, v_dim: int, documents: bool = False) -> str:
    """The kind a kernel runs as: ``sdpa`` on CPU runs the flash op for any head dims
    (kernels/sdpa.py pads the narrower one), keeping what ``fused`` keeps. With
    documents it hands torch SDPA a keep-mask per segment: the CPU flash kernel
    (plus the mask, as a float tensor) for equal head dims, else the math path."""
    if kernel != SDPA:
        return kernel
    if documents:
        return SDPA_FLASH if qk_dim == v_dim else SDPA_MATH
    return FUSED


@dataclass(frozen=True)
class Config(SplitView):  # algo, heads_split, split_size: asked of the CP algorithm
    dims: ModelDims
    seq_len: int
    micro_batch: int = 1
    cp_size: int = 1
    tp_size: int = 1
    cp_algo: str = "ulysses"
    layout: Optional[str] = None   # None: zigzag for allgather, contiguous for ulysses
    dtype: str = "bfloat16"
    kernel: str = FUSED
    causal: bool = True
    doc_lens: Optional[Tuple[int, ...]] = None   # packed documents' lengths (sum = seq_len)

    @cached_property  # asked per segment: built once (O(documents))
    def documents(self) -> Documents:
        """cu_seqlens (global document boundaries 0 ... S), or None: one sequence."""
        if not self.doc_lens:
            return None
        bounds = [0]
        for n in self.doc_lens:
            bounds.append(bounds[-1] + n)
        return tuple(bounds)
    # cp_algo="hybrid" only: U, the Ulysses group's size (heads split inside it, the
    # latent or K/V across the rest; docs/DESIGN.md "Hybrid CP"). 1 everywhere else.
    ulysses_degree: int = 1

    @property
    def elem(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def local_len(self) -> int:
        return self.seq_len // self.cp_size

    @property
    def rank_dims(self) -> MLADims:
        """The sizes one TP rank holds."""
        return self.dims.per_tp_rank(self.tp_size)

    @property
    def tp_heads(self) -> int:
        """Heads on this TP rank (n/TP): the rows of kv_up_weight it holds."""
        return self.rank_dims.heads

    @property
    def ring_size(self) -> int:
        """Hybrid: R = P/U, the ranks with the same Ulysses rank (explicit's K/V gather)."""
        return self.cp_size // self.ulysses_degree

    @property
    def attended_heads(self) -> int:
        """Heads this rank attends: n/TP (allgather), n/(TP*P) (ulysses), n/(TP*U) (hybrid)."""
        return self.algo.attended_heads(self.tp_heads, self.cp_size, self.ulysses_degree)

    @property
    def query_len(self) -> int:
        """Queries this rank attends: its own (allgather), every rank's (ulysses) or its
        Ulysses group's (hybrid: U*s)."""
        return self.algo.query_len(self.local_len, self.cp_size, self.ulysses_degree)

    @property
    def seq_layout(self) -> str:
        return self.layout or self.algo.default_layout

    @property
    def reorders(self) -> bool:
        """A rank-order gather is permuted to position order (index_select)."""
        return self.cp_size > 1 and self.seq_layout in ("zigzag", "doc_zigzag")

    @property
    def sizes(self) -> "Sizes":
        return Sizes(self.dims, self.elem, self.micro_batch, self.local_len, self.seq_len,
                     self.tp_heads, self.attended_heads)


@dataclass(frozen=True)
class Sizes:
    """The sizes every formula of the model uses, by their names in the docs."""

    dims: ModelDims
    elem: int        # e: bytes per element
    batch: int       # b
    local_len: int   # s: tokens per CP rank
    seq_len: int     # S: the full sequence
    tp_heads: int    # n: heads on this TP rank
    heads: int       # h: heads this rank attends


def with_(cfg: Config, **changes) -> Config:
    return replace(cfg, **changes)


def validate(cfg: Config, variants: Optional[Iterable[RunSpec]] = None) -> None:
    """ValueError naming the setting and the fix for anything the forms would reject."""
    d = cfg.dims
    for name, value in (("heads", d.heads), ("qk_head_dim", d.qk_head_dim),
                        ("qk_pos_emb_head_dim", d.rope_dim), ("v_head_dim", d.v_head_dim),
                        ("kv_lora_rank", d.kv_lora_rank), ("seq_len", cfg.seq_len),
                        ("micro_batch", cfg.micro_batch), ("cp_size", cfg.cp_size),
                        ("tp_size", cfg.tp_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    for name, value in (("hidden_size", d.hidden_size), ("q_lora_rank", d.q_lora_rank)):
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name} must be positive, got {value}")
    if cfg.cp_algo not in ATTN_CP_ALGOS:
        raise ValueError(f"cp_algo={cfg.cp_algo!r} is unknown; use one of {ATTN_CP_ALGOS}")
    _validate_hybrid(cfg)
    if cfg.seq_layout not in LAYOUTS:
        raise ValueError(f"layout={cfg.layout!r} is unknown; use one of {LAYOUTS}")
    if cfg.dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={cfg.dtype!r} is unknown; use one of {tuple(DTYPE_BYTES)}")
    if cfg.kernel not in MODEL_KERNELS:
        raise ValueError(f"kernel={cfg.kernel!r} is unknown; use one of {MODEL_KERNELS}")
    if d.heads % cfg.tp_size:
        raise ValueError(f"heads={d.heads} is not divisible by TP={cfg.tp_size}; "
                         "use a TP size that divides the heads")
    check_seq_len(cfg.seq_len, cfg.seq_layout, cfg.cp_size, ulysses_degree=cfg.ulysses_degree)
    if not cfg.algo.heads_divide(cfg.tp_heads, cfg.cp_size, cfg.ulysses_degree):  # hybrid: above
        raise ValueError(f"cp_algo='ulysses' splits the {cfg.tp_heads} heads per TP rank over "
                         f"CP={cfg.cp_size}: not divisible; use cp_algo='allgather' or a CP size "
                         "dividing heads/TP")
    check_doc_lens(cfg)
    for v in variants or ():
        if v.kv_block_size is not None and v.kv_block_size <= 0:
            raise ValueError(f"kv_block_size must be positive, got {v.kv_block_size}")


def doc_lens_for(seq_len: int, doc_lens: Optional[Sequence[int]] = None,
                 num_docs: Optional[int] = None) -> Optional[Tuple[int, ...]]:
    """Document lengths from ``--doc-lens`` or ``--num-docs`` (N equal documents)."""
    if doc_lens is not None and num_docs is not None:
        raise ValueError("--doc-lens and --num-docs both describe the documents; give one")
    if num_docs is not None:
        if not isinstance(num_docs, int) or num_docs <= 0:
            raise ValueError(f"--num-docs must be a positive integer, got {num_docs!r}")
        if seq_len % num_docs:
            raise ValueError(f"--num-docs {num_docs} does not divide the sequence length {seq_len} "
                             "into equal documents; give --doc-lens instead, or a divisor")
        return (seq_len // num_docs,) * num_docs
    if doc_lens is None:
        return None
    return tuple(doc_lens)


def check_doc_lens(cfg: Config) -> None:
    """Document lengths: positive, summing to the sequence length, cut as the layout needs."""
    if cfg.doc_lens is None:
        if cfg.seq_layout == "doc_zigzag" and cfg.cp_size > 1:
            raise ValueError("layout='doc_zigzag' cuts every document into 2*CP chunks: give the "
                             "documents (--doc-lens or --num-docs)")
        return
    lens = cfg.doc_lens
    if not lens or any(not isinstance(n, int) or isinstance(n, bool) or n <= 0 for n in lens):
        raise ValueError(f"--doc-lens must list positive integer document lengths, got {list(lens)}")
    if sum(lens) != cfg.seq_len:
        raise ValueError(f"--doc-lens sum to {sum(lens)}, not the sequence length {cfg.seq_len}: "
                         f"make them add up to {cfg.seq_len} (or set --seq-len {sum(lens)})")
    check_documents(cfg.documents, cfg.seq_len, cfg.seq_layout, cfg.cp_size)


def _validate_hybrid(cfg: Config) -> None:
    """U only with cp_algo='hybrid'; there a divisor of P dividing the heads per TP rank."""
    U = cfg.ulysses_degree
    if not isinstance(U, int) or isinstance(U, bool) or U <= 0:
        raise ValueError(f"ulysses_degree must be a positive integer, got {U!r}")
    if not cfg.algo.takes_ulysses_degree:
        if U != 1:
            raise ValueError(f"ulysses_degree={U} is given but cp_algo={cfg.cp_algo!r}; use "
                             "cp_algo='hybrid' (or drop ulysses_degree)")
        return
    if not cfg.algo.degree_divides(cfg.cp_size, U):
        raise ValueError(f"ulysses_degree={U} must be a positive divisor of CP={cfg.cp_size}")
    if not cfg.algo.heads_divide(cfg.dims.heads // cfg.tp_size, cfg.cp_size, U):
        raise ValueError(f"cp_algo='hybrid' splits the {cfg.dims.heads // cfg.tp_size} heads per TP "
                         f"rank over ulysses_degree={U}: not divisible; use a U dividing heads/TP")

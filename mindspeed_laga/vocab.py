"""The shared vocabulary: names, sizes and position arithmetic, free of torch.

The core, the cost model, the CLI and the host adapters all speak in these
terms, so each rule is written once:

- the choices a caller makes (forms, CP algorithms, layouts, kernels);
- the MLA sizes of one TP rank (:class:`MLADims`) and of the whole model
  (:class:`ModelDims`);
- which global positions each CP rank holds (the chunk rule and *segments*:
  runs of local tokens with consecutive global positions), which keys a
  segment can see, and how keys are cut into blocks.

See docs/DESIGN.md, sections "Layouts" and "Causal masks".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

FORMS = ("explicit", "absorbed", "laga")
CP_ALGOS = ("allgather", "ulysses")
# Hybrid CP (Ulysses inside a group of U ranks, the latent across the CP group):
# an algorithm of the attention core only, so it stays out of CP_ALGOS, which
# the cost model and the CLI enumerate.
HYBRID = "hybrid"
ATTN_CP_ALGOS = CP_ALGOS + (HYBRID,)
LAYOUTS = ("zigzag", "contiguous")
KERNELS = ("auto", "eager", "sdpa", "npu")
# The split each algorithm's host data pipeline produces when a caller names none.
DEFAULT_LAYOUT = {"allgather": "zigzag", "ulysses": "contiguous", HYBRID: "zigzag"}

Segment = Tuple[int, int, int]  # (local_start, length, global_start)


@dataclass(frozen=True)
class MLADims:
    """MLA sizes as one TP rank holds them (DeepSeek-V3 at TP=1: 128, 128, 64, 128, 512)."""

    heads: int          # n: heads on this TP rank
    qk_head_dim: int    # d_n
    rope_dim: int       # d_r (qk_pos_emb_head_dim)
    v_head_dim: int     # d_v
    kv_lora_rank: int   # d_c

    @property
    def qk_dim(self) -> int:
        """Query/key head dim: d_n + d_r."""
        return self.qk_head_dim + self.rope_dim

    @property
    def latent_dim(self) -> int:
        """Values per token LAGA gathers: d_c + d_r."""
        return self.kv_lora_rank + self.rope_dim


@dataclass(frozen=True)
class ModelDims:
    """MLA sizes of the whole model (heads before TP), as a model config states them."""

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

    def per_tp_rank(self, tp_size: int) -> MLADims:
        """The sizes one of ``tp_size`` tensor-parallel ranks holds."""
        return MLADims(self.heads // tp_size, self.qk_head_dim, self.rope_dim, self.v_head_dim,
                       self.kv_lora_rank)


def heads_split(cp_algo: str, cp_size: int, ulysses_degree: int = 1) -> bool:
    """Whether heads are split (ulysses: over the CP group; hybrid: over its Ulysses
    group of ``ulysses_degree`` ranks) rather than all kept."""
    if cp_algo == HYBRID:
        return ulysses_degree > 1
    return cp_algo == "ulysses" and cp_size > 1


@dataclass(frozen=True)
class AttnSetup:
    """Everything a form needs besides the tensors (made by ``validate.check``)."""

    dims: MLADims
    local_len: int
    batch: int
    cp_group: object
    cp_size: int
    cp_rank: int
    cp_algo: str
    layout: str
    causal: bool
    kernel: str
    softmax_scale: float
    # Hybrid CP only: the Ulysses group (U consecutive CP ranks holding this one) and U.
    # U also names the hybrid layout (docs/DESIGN.md "Hybrid CP"); 1 everywhere else.
    ulysses_group: object = None
    ulysses_degree: int = 1

    @property
    def heads_split(self) -> bool:
        """Heads split over the split group: Q goes out and O comes back by all-to-all."""
        return heads_split(self.cp_algo, self.cp_size, self.ulysses_degree)

    @property
    def split_group(self):
        """The group the head all-to-alls run over: the Ulysses group (hybrid) or cp_group."""
        return self.ulysses_group if self.cp_algo == HYBRID else self.cp_group

    @property
    def split_size(self) -> int:
        return self.ulysses_degree if self.cp_algo == HYBRID else self.cp_size

    @property
    def split_rank(self) -> int:
        return self.cp_rank % self.ulysses_degree if self.cp_algo == HYBRID else self.cp_rank

    @property
    def seq_len(self) -> int:
        """The full sequence length (every rank's tokens)."""
        return self.local_len * self.cp_size

    def head_slice(self) -> Tuple[int, int]:
        """(first, count): the heads this rank attends (all, or its n/P block)."""
        n = self.dims.heads
        if not self.heads_split:
            return 0, n
        h = n // self.split_size
        return self.split_rank * h, h

    def query_segments(self) -> List[Segment]:
        """Segments of the queries the attention sees on this rank."""
        return query_segments(self.layout, self.cp_size, self.cp_rank, self.local_len,
                              self.heads_split, ulysses_degree=self.ulysses_degree)

    def visible_keys(self) -> int:
        """Keys (from position 0) that at least one of this rank's queries sees."""
        return visible_keys(self.query_segments(), self.seq_len, self.causal)


# ---------------------------------------------------------------- layouts

def num_chunks(layout: str, cp_size: int) -> int:
    """How many equal pieces the full sequence is cut into: 2P (zigzag) or P."""
    return 2 * cp_size if layout == "zigzag" and cp_size > 1 else cp_size


def seq_multiple(layout: str, cp_size: int, ulysses_degree: int = 1) -> int:
    """The full sequence length must be a multiple of this.

    Hybrid zigzag (``ulysses_degree`` U > 1): 2R chunks (R = P/U) whose pairs
    are cut into U equal pieces, i.e. a multiple of lcm(2R, P).
    """
    if ulysses_degree == 1 or layout != "zigzag":
        return num_chunks(layout, cp_size)
    ring = cp_size // ulysses_degree
    return 2 * ring * cp_size // math.gcd(2 * ring, cp_size)


def check_seq_len(seq_len: int, layout: str, cp_size: int, *, ulysses_degree: int = 1) -> None:
    """The full sequence must cut into equal chunks (ValueError naming the padding)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; use one of {LAYOUTS}")
    if ulysses_degree < 1 or cp_size % ulysses_degree:
        raise ValueError(f"ulysses_degree={ulysses_degree} must be a positive divisor of "
                         f"CP={cp_size}")
    multiple = seq_multiple(layout, cp_size, ulysses_degree)
    if seq_len % multiple:
        why = ("2*CP" if multiple == 2 * cp_size else "CP") if ulysses_degree == 1 else \
            f"hybrid zigzag, CP={cp_size}, ulysses_degree={ulysses_degree}"
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {multiple} "
            f"({why} for layout={layout!r}, CP={cp_size}); pad it to a multiple of {multiple}")


def rank_segments(layout: str, cp_size: int, rank: int, local_len: int, *,
                  ulysses_degree: int = 1) -> List[Segment]:
    """The consecutive-position runs of rank ``rank``'s ``local_len`` tokens.

    ``ulysses_degree`` U > 1: hybrid CP, rank = r*U + u (r: ring rank, u:
    Ulysses rank). ``contiguous`` is unchanged (MindSpeed's general hybrid
    split); ``zigzag`` cuts the sequence into 2R chunks (R = P/U), ring rank r
    takes chunks r and 2R-1-r, and that pair is cut contiguously into U
    pieces, piece u on Ulysses rank u (MindSpeed's hybrid_cp_algo batch).
    """
    if cp_size == 1:
        return [(0, local_len, 0)]
    if layout == "contiguous":
        return [(0, local_len, rank * local_len)]
    if ulysses_degree > 1:
        ring, u = divmod(rank, ulysses_degree)
        pair = rank_segments(layout, cp_size // ulysses_degree, ring, ulysses_degree * local_len)
        return _cut(pair, u * local_len, local_len)
    c = local_len // 2
    return [(0, c, rank * c), (c, c, (2 * cp_size - 1 - rank) * c)]


def _cut(segments: List[Segment], start: int, length: int) -> List[Segment]:
    """The segments of local tokens [start, start + length), renumbered from 0."""
    out = []
    for ls, n, g in segments:
        lo, hi = max(ls, start), min(ls + n, start + length)
        if lo < hi:
            out.append((lo - start, hi - lo, g + lo - ls))
    return out


def query_segments(layout: str, cp_size: int, rank: int, local_len: int,
                   split_heads: bool, *, ulysses_degree: int = 1) -> List[Segment]:
    """Segments of the queries a rank attends.

    Local queries: this rank's own tokens. Heads split: the tokens of every
    rank of the split group in rank order, as the all-to-all delivers them
    (ulysses: the CP group; hybrid, ``ulysses_degree`` U > 1: the U
    consecutive ranks holding ``rank``).
    """
    if not split_heads:
        return rank_segments(layout, cp_size, rank, local_len, ulysses_degree=ulysses_degree)
    s = local_len
    if ulysses_degree > 1:
        first, members = rank - rank % ulysses_degree, ulysses_degree
    else:
        first, members = 0, cp_size
    return [(i * s + ls, n, g) for i in range(members)
            for ls, n, g in rank_segments(layout, cp_size, first + i, s,
                                          ulysses_degree=ulysses_degree)]


# ---------------------------------------------------------------- keys a query sees

def key_prefix(seg: Segment, total: int, causal: bool) -> int:
    """How many position-ordered keys (from position 0) a segment can see."""
    _, length, start = seg
    return start + length if causal else total


def visible_keys(segments: Iterable[Segment], total: int, causal: bool) -> int:
    """Keys [0, end) that at least one of the segments' queries sees."""
    return max(key_prefix(seg, total, causal) for seg in segments)


def key_blocks(num_keys: int, block_size: Optional[int]) -> List[Tuple[int, int]]:
    """Key blocks [k0, k1) in position order; None: one block of every key."""
    size = block_size or max(num_keys, 1)
    return [(k0, min(k0 + size, num_keys)) for k0 in range(0, num_keys, size)]

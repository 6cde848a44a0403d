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

import bisect
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
LAYOUTS = ("zigzag", "contiguous", "doc_zigzag")
# The layouts of one unbroken sequence (doc_zigzag needs document boundaries).
SEQUENCE_LAYOUTS = ("zigzag", "contiguous")
KERNELS = ("auto", "eager", "sdpa", "npu")
# The split each algorithm's host data pipeline produces when a caller names none.
DEFAULT_LAYOUT = {"allgather": "zigzag", "ulysses": "contiguous", HYBRID: "zigzag"}

Segment = Tuple[int, int, int]  # (local_start, length, global_start)
Documents = Optional[Tuple[int, ...]]  # cu_seqlens: global document boundaries, 0 ... S


class _DerivedDims:
    """The widths both kinds of dims derive alike."""

    @property
    def qk_dim(self) -> int:
        """Query/key head dim: d_n + d_r."""
        return self.qk_head_dim + self.rope_dim

    @property
    def latent_dim(self) -> int:
        """Values per token LAGA gathers: d_c + d_r."""
        return self.kv_lora_rank + self.rope_dim


@dataclass(frozen=True)
class MLADims(_DerivedDims):
    """MLA sizes as one TP rank holds them (DeepSeek-V3 at TP=1: 128, 128, 64, 128, 512)."""

    heads: int          # n: heads on this TP rank
    qk_head_dim: int    # d_n
    rope_dim: int       # d_r (qk_pos_emb_head_dim)
    v_head_dim: int     # d_v
    kv_lora_rank: int   # d_c


@dataclass(frozen=True)
class ModelDims(_DerivedDims):
    """MLA sizes of the whole model (heads before TP), as a model config states them."""

    heads: int
    qk_head_dim: int
    rope_dim: int
    v_head_dim: int
    kv_lora_rank: int
    hidden_size: Optional[int] = None   # only for the query-projection (overlap) estimate
    q_lora_rank: Optional[int] = None

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
    documents: Documents = None   # cu_seqlens (global), or None: one sequence
    pad_v: bool = False           # kernel "npu": zero-pad V to the q/k head dim for the fused op
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
                              self.heads_split, self.documents,
                              ulysses_degree=self.ulysses_degree)

    def key_ranges(self) -> List[Tuple[int, int]]:
        """Position ranges of the keys this rank's queries see (what trimming rebuilds)."""
        return key_ranges(self.query_segments(), self.seq_len, self.causal, self.documents)


# ---------------------------------------------------------------- layouts

def num_chunks(layout: str, cp_size: int) -> int:
    """How many equal pieces the full sequence (zigzag, contiguous) or each document
    (doc_zigzag) is cut into: 2P or P."""
    return 2 * cp_size if layout in ("zigzag", "doc_zigzag") and cp_size > 1 else cp_size


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


def rank_segments(layout: str, cp_size: int, rank: int, local_len: int,
                  documents: Documents = None, *, ulysses_degree: int = 1) -> List[Segment]:
    """The consecutive-position runs of rank ``rank``'s ``local_len`` tokens.

    ``documents`` (cu_seqlens) is needed by ``doc_zigzag`` only.
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
    if layout == "doc_zigzag":
        return _doc_zigzag_segments(cp_size, rank, documents)
    if ulysses_degree > 1:
        ring, u = divmod(rank, ulysses_degree)
        pair = rank_segments(layout, cp_size // ulysses_degree, ring, ulysses_degree * local_len)
        return _cut(pair, u * local_len, local_len)
    c = local_len // 2
    return [(0, c, rank * c), (c, c, (2 * cp_size - 1 - rank) * c)]


def _doc_zigzag_segments(cp_size: int, rank: int, documents: Documents) -> List[Segment]:
    """Every document cut into 2P chunks; rank r holds chunks r and 2P-1-r of each,
    documents in order (MindSpeed's megatron_cp split of EOD-padded batches)."""
    if documents is None:
        raise ValueError("layout='doc_zigzag' needs cu_seqlens= (the document boundaries)")
    out, local = [], 0
    for start, end in zip(documents[:-1], documents[1:]):
        c = (end - start) // (2 * cp_size)
        for chunk in (rank, 2 * cp_size - 1 - rank):
            out.append((local, c, start + chunk * c))
            local += c
    return out


def _cut(segments: List[Segment], start: int, length: int) -> List[Segment]:
    """The segments of local tokens [start, start + length), renumbered from 0."""
    out = []
    for ls, n, g in segments:
        lo, hi = max(ls, start), min(ls + n, start + length)
        if lo < hi:
            out.append((lo - start, hi - lo, g + lo - ls))
    return out


def query_segments(layout: str, cp_size: int, rank: int, local_len: int,
                   split_heads: bool, documents: Documents = None, *,
                   ulysses_degree: int = 1) -> List[Segment]:
    """Segments of the queries a rank attends.

    Local queries: this rank's own tokens. Heads split: the tokens of every
    rank of the split group in rank order, as the all-to-all delivers them
    (ulysses: the CP group; hybrid, ``ulysses_degree`` U > 1: the U
    consecutive ranks holding ``rank``).
    """
    if not split_heads:
        return rank_segments(layout, cp_size, rank, local_len, documents,
                             ulysses_degree=ulysses_degree)
    s = local_len
    if ulysses_degree > 1:
        first, members = rank - rank % ulysses_degree, ulysses_degree
    else:
        first, members = 0, cp_size
    return [(i * s + ls, n, g) for i in range(members)
            for ls, n, g in rank_segments(layout, cp_size, first + i, s, documents,
                                          ulysses_degree=ulysses_degree)]


# ---------------------------------------------------------------- documents

def check_documents(cu_seqlens, seq_len: int, layout: str, cp_size: int) -> Tuple[int, ...]:
    """cu_seqlens as a tuple of ints, checked (ValueError naming the fix)."""
    try:
        bounds = tuple(int(x) for x in cu_seqlens)
        exact = all(int(x) == x and not isinstance(x, bool) for x in cu_seqlens)
    except (TypeError, ValueError):
        raise ValueError("cu_seqlens must be a 1-D integer tensor or a list of ints (document "
                         f"boundaries 0 ... sequence length), got {cu_seqlens!r}") from None
    if not exact or len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seq_len:
        raise ValueError(f"cu_seqlens must hold integer document boundaries from 0 to the full "
                         f"sequence length (local length x CP = {seq_len}), got {list(bounds)}")
    if any(b <= a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must increase strictly (every document non-empty), got "
                         f"{list(bounds)}")
    if layout == "doc_zigzag" and cp_size > 1:
        bad = [b - a for a, b in zip(bounds[:-1], bounds[1:]) if (b - a) % (2 * cp_size)]
        if bad:
            raise ValueError(
                f"layout='doc_zigzag' cuts every document into 2*CP={2 * cp_size} equal chunks; "
                f"document lengths {bad} are not divisible by {2 * cp_size}: pad each document "
                f"to a multiple of {2 * cp_size} (as MindSpeed pads EOD-separated documents "
                "under --reset-attention-mask) or use layout='zigzag'/'contiguous'")
    return bounds


def document_of(pos: int, documents: Tuple[int, ...]) -> int:
    """Index of the document holding global position ``pos``."""
    return bisect.bisect_right(documents, pos) - 1


def doc_pieces(seg: Segment, documents: Documents) -> List[Segment]:
    """A segment cut at document boundaries (one piece when there are no documents)."""
    if documents is None:
        return [seg]
    local, length, g = seg
    out = []
    while length:
        end = documents[document_of(g, documents) + 1]
        n = min(length, end - g)
        out.append((local, n, g))
        local, length, g = local + n, length - n, g + n
    return out


def key_window(seg: Segment, total: int, causal: bool, documents: Documents = None) -> Tuple[int, int]:
    """[lo, hi): the position-ordered keys some query of ``seg`` can see.

    Without documents lo is 0; with them it is the start of the first query's
    document and (non-causal) hi the end of the last query's document.
    """
    _, length, g = seg
    if documents is None:
        return 0, key_prefix(seg, total, causal)
    lo = documents[document_of(g, documents)]
    hi = g + length if causal else documents[document_of(g + length - 1, documents) + 1]
    return lo, hi


# ---------------------------------------------------------------- keys a query sees

def key_prefix(seg: Segment, total: int, causal: bool) -> int:
    """How many position-ordered keys (from position 0) a segment can see."""
    _, length, start = seg
    return start + length if causal else total


def visible_keys(segments: Iterable[Segment], total: int, causal: bool) -> int:
    """Keys [0, end) that at least one of the segments' queries sees."""
    return max(key_prefix(seg, total, causal) for seg in segments)


def key_ranges(segments: Iterable[Segment], total: int, causal: bool,
               documents: Documents = None) -> List[Tuple[int, int]]:
    """Sorted, disjoint [lo, hi) position ranges holding every key some query sees
    (without documents: the one prefix [0, visible_keys))."""
    windows = sorted(key_window(seg, total, causal, documents) for seg in segments)
    merged: List[List[int]] = []
    for lo, hi in windows:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


# Query rows per row block of the blockwise walk, in keys per block. Each row block
# rebuilds the K/V of the key blocks it sees, so rows per block trade rebuild work
# (about ``(S / rows + 1) / 2`` rebuilds of every key, causal) against the float32
# accumulators that live for one row block (dq in backward, the output in forward).
QUERY_BLOCK_KEYS = 2


def query_block_rows(block_size: Optional[int]) -> Optional[int]:
    """Query rows a blockwise walk takes at once; None (one block of keys): whole segments."""
    return None if block_size is None else QUERY_BLOCK_KEYS * block_size


def join_adjacent(segments: Iterable[Segment]) -> List[Segment]:
    """Segments with each one that continues the previous (next local row, next position)
    joined to it: ulysses' contiguous layout delivers every rank's tokens as one segment
    each, in position order; the blockwise walk cuts its row blocks from the joined runs
    so that the row blocks, not the ranks, set how often keys are rebuilt."""
    out: List[Segment] = []
    for local, n, g in segments:
        if out and out[-1][0] + out[-1][1] == local and out[-1][2] + out[-1][1] == g:
            out[-1] = (out[-1][0], out[-1][1] + n, out[-1][2])
        else:
            out.append((local, n, g))
    return out


def key_blocks(num_keys: int, block_size: Optional[int]) -> List[Tuple[int, int]]:
    """Key blocks [k0, k1) in position order; None: one block of every key."""
    size = block_size or max(num_keys, 1)
    return [(k0, min(k0 + size, num_keys)) for k0 in range(0, num_keys, size)]

"""LAGA with K/V rebuilt blockwise and recomputed in backward.

The paper's LAGA keeps per-head K/V of every key for backward: [S, h, d_qk+d_v]
per rank, the largest activation of the block at long sequence. Every rank
already holds the gathered latent (d_c + d_r per token), so K/V can be
rebuilt when needed instead of kept.

The walk goes tile by tile: each query segment in row blocks of
``vocab.blocks.query_block_rows(block_size)`` rows, and for each row block the
(position-ordered) keys in blocks of ``block_size`` it can see. Forward
rebuilds the span of a key block the row block sees, attends it and merges
with an online softmax (running max and sum, as ring/flash attention do).
Only ``q``, the gathered latent, the output and the float32 log-sum-exp are
saved. Backward walks the tiles again, rebuilds each tile's K/V, forms the
probabilities from the saved log-sum-exp, and pushes dK/dV straight back
through the up-projection to the latent and ``kv_up_weight``. Full-sequence
K/V never exist, in forward or backward; the float32 running output (forward)
and dq (backward) exist for one row block, which is why rows are blocked too:
with keys outermost they would span the whole sequence.

Each tile's runs of query rows go to a block kernel (``kernels/block.py``; with
documents, all runs of one query segment in a block go at once to a kernel
that offers the packed entry):
eager math with one block's scores materialized, or ``npu_fusion_attention``
and ``npu_fusion_attention_grad``, whose softmax statistics merge blocks the
same way. Accumulation is float32 for half-precision inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import List, NamedTuple, Optional, Tuple

import torch

from ..double_backward import once_differentiable
from ..kernels import KeyIndex, held_keys, nonfinite, poison_rows
from ..kernels.base import Kernel
from ..kernels.declared.eager import Eager
from ..kernels.merge import merge_into
from ..kernels.precision import acc_dtype
from ..vocab.attn_setup import AttnSetup
from ..vocab.blocks import join_adjacent, query_block_rows
from ..vocab.dims import MLADims
from ..vocab.documents import doc_pieces
from ..vocab.keys import key_blocks, key_window
from ..vocab.segments import Documents, Segment
from .common import rebuild_kv


@dataclass(frozen=True)
class BlockPlan:
    """The walk's view of one call: :meth:`from_setup` derives it from the checked setup."""

    dims: MLADims                # this TP rank's MLA sizes (heads: those of the setup)
    scale: float
    causal: bool
    segments: Tuple[Segment, ...]
    block_size: Optional[int]    # keys per rebuilt block; None = one block
    kernel: Kernel = Eager()     # the setup's kernel (its block kernel runs the tiles)
    documents: Documents = None  # cu_seqlens: a query sees only its own document
    key_ranges: Optional[Tuple[Tuple[int, int], ...]] = None  # positions the latent holds
    # key padding of the keys the latent holds, [b, K] bool (True = padding), or None
    key_padding: Optional[torch.Tensor] = field(default=None, compare=False)

    @classmethod
    def from_setup(cls, setup: AttnSetup, block_size: Optional[int], key_ranges=None) -> "BlockPlan":
        padding = setup.key_padding
        return cls(dims=setup.dims, scale=setup.softmax_scale, causal=setup.causal,
                   segments=tuple(setup.query_segments()), block_size=block_size,
                   kernel=setup.kernel, documents=setup.documents,
                   key_ranges=tuple(key_ranges) if key_ranges else None,
                   key_padding=None if padding is None else held_keys(padding, key_ranges))


class Run(NamedTuple):
    """Query rows of one segment and document that see a key block: ``rows`` (a slice of
    the local queries), ``keys`` (a slice of the block handed to the kernel) and the
    kernels' causal ``offset`` (key j visible to row i iff j <= i + offset; None: all)."""
    rows: slice
    keys: slice
    offset: Optional[int]


def visible_rows(plan: BlockPlan, k0: int, k1: int):
    """(query rows, key slice, offset) for each run of rows that sees a key of [k0, k1).

    Runs are the query segments cut at document boundaries. A run sees the keys
    of its document up to its own positions (causal) or all of them, and
    nothing else, so a block with no visible (query, key) pair makes no call.
    Rows before the block's first visible key are cut, so every row handed to
    a block kernel sees at least one key; keys no row of the run sees are cut
    too (the key slice is relative to ``k0``). ``offset`` is the block
    kernels' causal offset (``kernels/masks.py``): key j of the slice is visible to
    row i of the run iff ``j <= i + offset``; None when every key is.
    """
    for runs in segment_runs(plan, k0, k1):
        yield from runs


def segment_runs(plan: BlockPlan, k0: int, k1: int):
    """The runs of :func:`visible_rows` grouped by query segment: one non-empty list per
    segment that sees the block, runs in row order (one per document it crosses)."""
    # Untrimmed, key index = position, and a window's end past k1 is cut anyway.
    keys = KeyIndex(plan.key_ranges, k1) if plan.key_ranges else None
    total = plan.key_ranges[-1][1] if plan.key_ranges else k1
    for seg in plan.segments:
        runs = [run for piece in doc_pieces(seg, plan.documents)
                if (run := _run(plan, piece, keys, total, k0, k1)) is not None]
        if runs:
            yield runs


def _run(plan: BlockPlan, piece, keys, total: int, k0: int, k1: int):
    local, n, g = piece
    lo, hi = key_window(piece, total, plan.causal, plan.documents)
    base = keys.index(lo) - lo if keys else 0  # key index of position p: base + p
    a, e = max(k0, base + lo), min(k1, base + hi)
    if a >= e:
        return None
    first = max(0, a - (base + g)) if plan.causal else 0
    if first >= n:
        return None
    offset = base + g + first - a if plan.causal else None
    if offset is not None and offset >= e - a - 1:
        offset = None
    return Run(slice(local + first, local + n), slice(a - k0, e - k0), offset)


def rebuild(latent_block: torch.Tensor, kv_up_weight: torch.Tensor, plan: BlockPlan):
    """[B, b, d_c + d_r] -> K [b, h, B, d_n + d_r], V [b, h, B, d_v] (Megatron's math)."""
    d = plan.dims
    kv_c, k_pe = torch.split(latent_block, [d.kv_lora_rank, d.rope_dim], dim=-1)
    key, value = rebuild_kv(kv_c, k_pe, kv_up_weight, d.qk_head_dim, d.v_head_dim)
    return key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)


def row_blocks(plan: BlockPlan) -> List[Segment]:
    """The query rows in blocks of ``vocab.query_block_rows``: the segments, adjacent ones
    joined (``vocab.join_adjacent``), cut into pieces (local start, rows, first position)
    that are walked one at a time."""
    size = query_block_rows(plan.block_size)
    out = []
    for local, n, g in join_adjacent(plan.segments):
        step = size or n
        out += [Segment(local + i, min(step, n - i), g + i) for i in range(0, n, step)]
    return out


@dataclass(frozen=True)
class Tile:
    """One (row block, key block) pair with visible keys: the key span [k0, k1) to rebuild
    (the keys some row of the block sees, cut to the key block) and the walk's runs, key
    slices relative to ``k0``."""
    k0: int
    k1: int
    runs: List[Run]


def tiles(plan: BlockPlan, rows: Segment, num_keys: int) -> List[Tile]:
    """The key blocks a row block sees, each cut to the span its runs use."""
    sub = replace(plan, segments=(rows,))
    out = []
    for k0, k1 in key_blocks(num_keys, plan.block_size):
        runs = [run for seg in segment_runs(sub, k0, k1) for run in seg]
        if runs:
            a, e = min(r.keys.start for r in runs), max(r.keys.stop for r in runs)
            out.append(Tile(k0 + a, k0 + e, [Run(r.rows, slice(r.keys.start - a, r.keys.stop - a),
                                                 r.offset) for r in runs]))
    return out


def walk(plan: BlockPlan, num_keys: int) -> List[Tuple[Segment, List[Tile]]]:
    """Every row block with its tiles: the whole walk, planned once per call (forward
    plans it, backward walks the same tiles again)."""
    return [(rows, tiles(plan, rows, num_keys)) for rows in row_blocks(plan)]


def tile_padding(plan: BlockPlan, tile):
    """The tile's key padding [b, k1 - k0], or None without padding."""
    return None if plan.key_padding is None else plan.key_padding[:, tile.k0:tile.k1]


def forward_runs(kernel, q, key, value, runs, scale, pad=None):
    """[(out, lse)] of one segment's runs against a block; with key padding ``pad`` [b, B]
    (never with documents) one call per run with its keys' padding, else the kernel's
    (packed) entry."""
    if pad is None:
        return kernel.forward_runs(q, key, value, runs, scale)
    return [kernel.forward(q[:, :, rows], key[:, :, ks], value[:, :, ks], offset, scale,
                           pad=pad[:, ks]) for rows, ks, offset in runs]


def backward_runs(kernel, q, key, value, runs, scale, d_out, out, lse, pad=None):
    """[(dq, dk, dv)] of one segment's runs, as :func:`forward_runs` calls them."""
    if pad is None:
        return kernel.backward_runs(q, key, value, runs, scale, d_out, out, lse)
    return [kernel.backward(q[:, :, rows], key[:, :, ks], value[:, :, ks], offset, scale,
                            d_out[:, :, rows], out[:, :, rows], lse[:, :, rows], pad=pad[:, ks])
            for rows, ks, offset in runs]


def _shift(rows: slice, by: int) -> slice:
    return slice(rows.start - by, rows.stop - by)


def latent_block(latent: torch.Tensor, bad: torch.Tensor, tile) -> torch.Tensor:
    """The tile's latent rows with non-finite positions (``bad`` [S, b]) zeroed, a copy of
    one key block (kernels/nonfinite.py: the rows that see them are poisoned instead)."""
    return latent[tile.k0:tile.k1].masked_fill(bad[tile.k0:tile.k1, :, None], 0)


def rebuild_finite(block: torch.Tensor, kv_up_weight: torch.Tensor, plan: BlockPlan):
    """:func:`rebuild`, then (K, V, their non-finite positions [b, h, B]) with those zeroed.

    A finite latent can still rebuild to inf (float16 overflow of the up-projection); the
    kernels would spread it to every row of the block (0 x inf), so the rebuilt K/V are
    cleaned like any non-finite key (kernels/nonfinite.py) and the rows that see such a
    position are poisoned after the walk, per head, as the non-recompute path does."""
    key, value = rebuild(block, kv_up_weight, plan)
    bad = nonfinite.bad_positions(key, value)
    return (nonfinite.zero_bad_positions(key, bad, in_place=True),
            nonfinite.zero_bad_positions(value, bad, in_place=True), bad)


def blockwise_forward(q, latent, kv_up_weight, plan: BlockPlan, steps, bad, overflow):
    """Attention over rebuilt key blocks, merged by log-sum-exp -> (out, lse float32).
    ``overflow`` [b, h, S] collects the positions whose rebuilt K/V were not finite.

    Row block by row block (``steps``: :func:`walk`): the float32 running output and log-sum-exp exist for
    one row block at a time. ``out`` is laid out [s, b, h, d_v] in memory (a BNSD
    view), so the [s, b, h*d_v] output the caller gets is the same storage that
    backward keeps."""
    kernel = plan.kernel.block
    b, h, s_q, _ = q.shape  # q [b, h, s_q, d_n + d_r]; latent [S, b, d_c + d_r]
    acc = acc_dtype(q.dtype)
    out = torch.zeros(s_q, b, h, plan.dims.v_head_dim, dtype=q.dtype, device=q.device).permute(1, 2, 0, 3)
    lse = torch.full((b, h, s_q), float("-inf"), dtype=acc, device=q.device)  # [b, h, s_q]
    for (r0, n, _), row_tiles in steps:  # one row block: rows [r0, r0 + n)
        acc_out = torch.zeros(b, h, n, plan.dims.v_head_dim, dtype=acc, device=q.device)  # [b, h, n, d_v]
        acc_lse = lse[:, :, r0:r0 + n]  # [b, h, n], a view: merged in place
        for tile in row_tiles:
            # K [b, h, k1 - k0, d_n + d_r], V [b, h, k1 - k0, d_v]: one tile's span, rebuilt
            key, value, tile_bad = rebuild_finite(latent_block(latent, bad, tile), kv_up_weight,
                                                  plan)
            overflow[:, :, tile.k0:tile.k1] |= tile_bad
            pad = tile_padding(plan, tile)  # [b, k1 - k0] or None
            for (r, _, _), (block_out, block_lse) in zip(
                    tile.runs, forward_runs(kernel, q, key, value, tile.runs, plan.scale, pad)):
                merge_into(acc_out, acc_lse, _shift(r, r0), block_out, block_lse,
                           may_be_empty=pad is not None)
        out[:, :, r0:r0 + n] = acc_out
    return out, lse


def blockwise_backward(q, latent, kv_up_weight, out, lse, d_out, plan: BlockPlan, steps, bad):
    """Grads of q, the gathered latent and kv_up_weight, one (row block, key block) tile
    at a time (``steps``: forward's :func:`walk`): float32 dq for one row block, K/V and their grads for one tile."""
    kernel = plan.kernel.block
    acc = acc_dtype(q.dtype)
    dq = torch.zeros_like(q)  # q's dtype and memory layout; each row block written once
    d_latent = torch.zeros(latent.shape, dtype=acc, device=q.device)
    d_weight = torch.zeros(kv_up_weight.shape, dtype=acc, device=q.device)
    weight = kv_up_weight.to(push_dtype(q))
    for (r0, n, _), row_tiles in steps:  # one row block: rows [r0, r0 + n)
        dq_rows = torch.zeros(*q.shape[:2], n, q.shape[3], dtype=acc, device=q.device)  # [b, h, n, d_qk]
        for tile in row_tiles:
            block = latent_block(latent, bad, tile)  # [k1 - k0, b, d_c + d_r]
            key, value, _ = rebuild_finite(block, kv_up_weight, plan)  # [b, h, k1 - k0, .], as forward
            grads = backward_runs(kernel, q, key, value, tile.runs, plan.scale, d_out, out, lse,
                                  tile_padding(plan, tile))
            for (r, _, _), (dq_b, _, _) in zip(tile.runs, grads):
                dq_rows[:, :, _shift(r, r0)] += dq_b
            d_key, d_value = _tile_grads(key, value, tile.runs, grads)
            _through_rebuild(block, weight, d_key, d_value, d_latent[tile.k0:tile.k1], d_weight,
                             plan)
            del block, key, value, grads, d_key, d_value
        dq[:, :, r0:r0 + n] = dq_rows
    return dq, d_latent.to(latent.dtype), d_weight.to(kv_up_weight.dtype)


def _tile_grads(key, value, runs, grads):
    """dK, dV of the tile from its runs' grads. The runs of one row block are documents
    of one segment: their key slices are disjoint, so they are placed, never summed, and
    stay in the kernel's dtype (one run over the whole span is used as it is)."""
    (_, ks, _), (_, dk, dv) = runs[0], grads[0]
    if len(runs) == 1 and ks.start == 0 and ks.stop == key.shape[2]:
        return dk, dv
    d_key = key.new_zeros(key.shape, dtype=dk.dtype)
    d_value = value.new_zeros(value.shape, dtype=dv.dtype)
    for (_, ks, _), (_, dk, dv) in zip(runs, grads):
        d_key[:, :, ks] = dk
        d_value[:, :, ks] = dv
    return d_key, d_value


def push_dtype(q: torch.Tensor) -> torch.dtype:
    """dtype of the matmuls that push a tile's dK/dV through the rebuild: on accelerators
    the input's (half-precision matmuls are their fast path; one rounding a tile, added
    into float32), on CPU the accumulation dtype (its half-precision matmuls are slow)."""
    return acc_dtype(q.dtype) if q.device.type == "cpu" else q.dtype


def _through_rebuild(latent_block, weight, d_key, d_value, d_latent_block, d_weight, plan):
    """Backward of :func:`rebuild`, added into the float32 accumulators: dK, dV [b,h,B,.]
    -> latent block and weight grads, the matmuls in ``weight``'s dtype (:func:`push_dtype`)."""
    d = plan.dims
    d_nope, d_pe = torch.split(d_key, [d.qk_head_dim, d.rope_dim], dim=-1)
    d_kv = torch.cat([d_nope.to(weight.dtype), d_value.to(weight.dtype)], dim=-1)
    d_kv = d_kv.permute(2, 0, 1, 3)  # [B, b, h, d_n + d_v]
    d_kv = d_kv.reshape(*d_kv.shape[:2], -1)
    kv_c = latent_block[..., :d.kv_lora_rank].to(weight.dtype)
    d_latent_block[..., :d.kv_lora_rank] += torch.matmul(d_kv, weight)
    d_latent_block[..., d.kv_lora_rank:] += d_pe.sum(dim=1).permute(1, 0, 2)
    d_weight += torch.matmul(d_kv.reshape(-1, d_kv.shape[-1]).t(), kv_c.reshape(-1, kv_c.shape[-1]))


class BlockwiseLAGA(torch.autograd.Function):
    """Autograd boundary: saves q, the gathered latent, the output and the lse only.

    A non-finite latent position is zeroed in every rebuilt block (forward and
    backward), so are rebuilt K/V that overflow, and the rows that see either come
    out NaN (kernels/nonfinite.py), in
    the output backward keeps too, so their gradients are NaN as exact
    attention's would be."""

    @staticmethod
    def forward(ctx, q, latent, kv_up_weight, plan: BlockPlan):
        bad = nonfinite.bad_positions(latent)  # [S, b]; kept as is (S*b bools), not saved
        steps = walk(plan, latent.shape[0])
        overflow = torch.zeros(q.shape[0], q.shape[1], latent.shape[0], dtype=torch.bool,
                               device=q.device)  # [b, h, S]: rebuilt keys that overflowed
        out, lse = blockwise_forward(q, latent, kv_up_weight, plan, steps, bad, overflow)
        seen = bad.t()[:, None] | overflow  # [b, h, S]
        if plan.key_padding is not None:  # a padding key is seen by no row: it poisons none
            seen = seen & ~plan.key_padding[:, None]
        out.add_(poison_rows(seen, segments=list(plan.segments), causal=plan.causal,
                             documents=plan.documents, key_ranges=plan.key_ranges,
                             dtype=out.dtype))
        ctx.save_for_backward(q, latent, kv_up_weight, out, lse)
        ctx.plan, ctx.steps, ctx.bad = plan, steps, bad
        return out

    @staticmethod
    @once_differentiable("laga_attention(recompute_kv=True)",
                         "use recompute_kv=False with kernel='eager' for second-order grads")
    def backward(ctx, d_out):
        q, latent, kv_up_weight, out, lse = ctx.saved_tensors
        # forward ran with autocast off (api.py); a backward called inside an autocast
        # region must not recast the float32 accumulations
        with torch.autocast(q.device.type, enabled=False):
            dq, d_latent, d_weight = blockwise_backward(q, latent, kv_up_weight, out, lse, d_out,
                                                        ctx.plan, ctx.steps, ctx.bad)
        return dq, d_latent, d_weight, None

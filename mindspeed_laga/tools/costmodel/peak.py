"""Peak memory of one attention call (forward + backward) above its inputs, as named terms.

What a device's allocator peaks at (``max_memory_allocated`` after
``reset_peak_memory_stats``, inputs and the output gradient already allocated):

- ``saved``: the activations autograd keeps (``memory.saved_terms``), alive
  from forward into backward, less the storages that are the call's inputs
  (``query``, ``kv_latent``: allocated before the peak is reset);
- ``output``: the attention output the caller holds [s, b, n*d_v];
- the largest *transient*, one of:
  - ``kernel_workspace``: what a kernel call holds besides what it keeps, for
    the largest segment: the eager kernel's scores and masked scores (compute
    dtype), SDPA math's likewise, a fused kernel's float32 output and
    log-sum-exp scratch (the two calls of a bottom-right segment merged);
  - ``backward_buffers``: while the kernel's backward runs (its saved tensors
    still alive) its grads dq, dK, dV (the sizes of q, K, V: for explicit
    under CP the gathered K/V grads before their reduce-scatter) plus, for the
    latent forms under CP, the gathered latent's grad, plus the kernel's
    backward workspace (eager: dP and dS, as big as the scores);
  - blockwise (``recompute_kv``), walked tile by tile (a row block of
    queries against a block of keys): in backward, dq in q's dtype, the float32
    latent and kv_up_weight grads and one row block's float32 dq, plus one
    tile's K/V, their grads and the larger of the kernel call (its dq and
    scratch: eager scores of a few heads, fused float32 output and lse) and the
    push through the rebuild; in forward, one tile's K/V, the row block's
    float32 running output and the kernel's block output. Without an
    all-to-all after it the output autograd keeps is the caller's output, so
    ``attn_out`` is not counted twice.

An estimate written from the code, not a measurement: ``bench`` prints it
beside the measured peak (:func:`mindspeed_laga.tools.measure.peak_check`):
``max_memory_allocated`` on CUDA/NPU, on CPU the allocator's events under the
torch profiler (``cpu_peak.py``), where the model also counts the CPU flash
op's zero-padded copies (it takes one head dim).
"""
from __future__ import annotations

from typing import List

from ..runspec import RunSpec
from ...vocab.blocks import SCORE_CHUNK_ELEMENTS
from .config import EAGER, HALF, RECOMPUTING_KINDS, SDPA, Config

# Saved terms that are the call's own inputs (allocated before the peak is reset).
INPUT_STORAGES = ("query", "kv_latent")
from .geometry import block_keys, query_segments, rebuilt_keys, largest_row_block
from .memory import Term, saved_terms


def _acc(cfg: Config) -> int:
    """Bytes per element of the float32 accumulators (float64 stays float64)."""
    return 4 if cfg.dtype in HALF or cfg.elem < 4 else cfg.elem


def _widths(cfg: Config, spec: RunSpec):
    d = cfg.dims
    return (d.latent_dim, d.kv_lora_rank) if spec.form == "absorbed" else (d.qk_dim, d.v_head_dim)


def _largest_scores(cfg: Config, rank: int, heads: int) -> int:
    """Elements of the largest segment's score matrix [b, h, s_q, keys]."""
    return max(cfg.micro_batch * heads * q.length * q.keys for q in query_segments(cfg, rank))


def _kernel_workspace(cfg: Config, rank: int, kind: str, spec: RunSpec) -> int:
    z = cfg.sizes
    acc = _acc(cfg)
    if kind in RECOMPUTING_KINDS:
        # a segment whose window is longer than its queries runs as two calls merged by
        # log-sum-exp (kernels/sdpa.py): float32 output and lse of both; else the lse only
        qk_dim, v_dim = _widths(cfg, spec)
        return max(2 * z.batch * z.heads * q.length * (v_dim + 1) * acc if q.keys != q.length
                   else z.batch * z.heads * q.length * acc for q in query_segments(cfg, rank)) \
            + _cpu_padding(cfg, rank, qk_dim, v_dim)
    return 2 * _largest_scores(cfg, rank, z.heads) * acc  # scores and masked scores (or dP, dS)


def _cpu_padding(cfg: Config, rank: int, qk_dim: int, v_dim: int) -> int:
    """The CPU flash op takes one head dim (kernels/sdpa.CpuFlash): its backward gets V,
    dO and O zero-padded to d_qk and returns a padded dV, four [b, h, rows|keys, d_qk]
    copies of the largest segment's call."""
    if cfg.kernel != SDPA or v_dim >= qk_dim:
        return 0
    z = cfg.sizes
    return max(4 * z.batch * z.heads * max(q.length, q.keys) * qk_dim * z.elem
               for q in query_segments(cfg, rank))


def _kernel_grads(cfg: Config, rank: int, spec: RunSpec) -> int:
    """dq, dK, dV of the kernel call (the sizes of its q, K, V), and the gathered latent's
    grad of the latent forms under CP."""
    z = cfg.sizes
    d, e, b, h = z.dims, z.elem, z.batch, z.heads
    qk, vd = _widths(cfg, spec)
    keys = z.seq_len if cfg.cp_size > 1 else z.local_len
    latent = keys * b * d.latent_dim * e if cfg.cp_size > 1 and spec.form != "explicit" else 0
    if spec.form == "absorbed":  # one key/value head shared by all query heads
        return b * h * cfg.query_len * qk * e + keys * b * (qk + vd) * e + latent
    if spec.form == "laga":
        keys = rebuilt_keys(cfg, rank, spec)
    return b * h * (cfg.query_len * qk + keys * (qk + vd)) * e + latent


def _kernel_grad_bytes(cfg: Config) -> int:
    """Bytes per element of what a block kernel returns: float32 for the eager kernel,
    the op's (the input) dtype for the fused and NPU ops."""
    return _acc(cfg) if cfg.kernel == EAGER else cfg.sizes.elem


def _block_scratch(cfg: Config, rows: int, block: int) -> int:
    """A block kernel call's own scratch for ``rows`` query rows against ``block`` keys."""
    z = cfg.sizes
    b, h, acc = z.batch, z.heads, _acc(cfg)
    if cfg.kernel == EAGER:  # EagerBlock: float32 scores and probabilities, a few heads at a time
        step = max(1, min(h, SCORE_CHUNK_ELEMENTS // max(1, b * rows * block)))
        return 2 * b * step * rows * block * acc
    # fused ops: float32 output and lse of the two calls of a diagonal block, merged; the
    # CPU flash op takes one head dim: V, dO and O padded to d_qk, and a padded dV back
    d = z.dims
    pad = 2 * b * h * (rows + block) * d.qk_dim * z.elem \
        if cfg.kernel == SDPA and d.v_head_dim < d.qk_dim else 0
    return 2 * b * h * rows * (d.v_head_dim + 1) * acc + pad


def _blockwise_forward(cfg: Config, rows: int, block: int) -> int:
    """Forward of one tile: its K/V, the row block's float32 running output, the kernel's
    block output (with its scratch) and the merge's product."""
    z = cfg.sizes
    d, e, b, h, acc = z.dims, z.elem, z.batch, z.heads, _acc(cfg)
    return (b * h * block * (d.qk_dim + d.v_head_dim) * e
            + 2 * b * h * rows * d.v_head_dim * acc
            + _block_scratch(cfg, rows, block))


def _blockwise_backward(cfg: Config, rank: int, spec: RunSpec, rows: int, block: int) -> int:
    """Backward: dq (q's dtype, written row block by row block), the float32 latent and
    weight grads, one row block's float32 dq; per tile its K/V and their grads, then the
    larger of the kernel call (its dq and scratch) and the push through the rebuild."""
    z = cfg.sizes
    d, e, b, h, acc = z.dims, z.elem, z.batch, z.heads, _acc(cfg)
    g = _kernel_grad_bytes(cfg)
    weight = z.tp_heads * (d.qk_head_dim + d.v_head_dim) * d.kv_lora_rank
    kv = b * h * block * (d.qk_dim + d.v_head_dim)
    whole = (b * h * cfg.query_len * d.qk_dim * e
             + rebuilt_keys(cfg, rank, spec) * b * d.latent_dim * acc + weight * acc
             + b * h * rows * d.qk_dim * acc)
    if cfg.heads_split:  # the output grad after its all-to-all, [S, b, h, d_v]
        whole += b * h * cfg.query_len * d.v_head_dim * e
    # the push through the rebuild: on CPU in the accumulation dtype (its weight copied once)
    p = acc if cfg.kernel in (EAGER, SDPA) else e
    if p != e:
        whole += weight * p
    call = b * h * rows * d.qk_dim * g + _block_scratch(cfg, rows, block)
    push = 2 * b * h * block * (d.qk_head_dim + d.v_head_dim) * p + weight * p
    return whole + kv * (e + g) + max(call, push)


def _blockwise_buffers(cfg: Config, rank: int, spec: RunSpec) -> int:
    rows = largest_row_block(cfg, rank, spec)
    block = block_keys(cfg, rank, spec)
    return max(_blockwise_forward(cfg, rows, block),
               _blockwise_backward(cfg, rank, spec, rows, block))


def _shares_output(spec: RunSpec, cfg: Config) -> bool:
    """The blockwise output autograd keeps is the caller's output (no all-to-all after it)."""
    return spec.recompute_kv and not cfg.heads_split


def peak_terms(cfg: Config, rank: int, kind: str, spec: RunSpec) -> List[Term]:
    """``saved`` + ``output`` + the largest transient, each a named :class:`Term`."""
    z = cfg.sizes
    skip = INPUT_STORAGES + (("attn_out",) if _shares_output(spec, cfg) else ())
    saved = sum(t.bytes for t in saved_terms(cfg, rank, kind, spec) if t.name not in skip)
    out = [Term("saved", "activations kept for backward (memory.saved_terms), less the "
                "inputs' own storages (and the output's, when it is the one kept)", saved),
           Term("output", f"attention output [s, b, {z.tp_heads}*d_v]",
                z.local_len * z.batch * z.tp_heads * z.dims.v_head_dim * z.elem)]
    if spec.recompute_kv:
        candidates = [Term("blockwise_buffers", "dq, the float32 latent/kv_up_weight grads "
                           "and one row block's dq; one tile's K/V, their grads and the kernel "
                           "call or the push through the rebuild (or the forward's tile)",
                           _blockwise_buffers(cfg, rank, spec))]
    else:
        work = _kernel_workspace(cfg, rank, kind, spec)
        candidates = [
            Term("kernel_workspace", "the largest segment's scores (eager/math) or float32 "
                 "output/lse scratch (fused)", work),
            Term("backward_buffers", "the kernel's dq/dK/dV (gathered grads before the "
                 "reduce-scatter) + its backward workspace", _kernel_grads(cfg, rank, spec) + work)]
    out.append(max(candidates, key=lambda t: t.bytes))
    return out

"""Attention of query rows against one rebuilt key block, for the blockwise LAGA.

Interface every block kernel (``Kernel.block``) follows (the walk in
``forms/laga_blockwise.py`` calls it once per (key block, run of query rows) pair; a
run is a query segment, cut at document boundaries when there are documents).
"float32" below is the accumulation dtype :func:`acc_dtype`: float32 for half
inputs, the input dtype (float32, float64) otherwise.

- Tensors are BNSD: ``q`` [b, h, rows, d_qk], ``key`` [b, h, B, d_qk],
  ``value`` [b, h, B, d_v] (``d_v`` may be below ``d_qk``, or equal to it when
  V was zero-padded); any float dtype; ``scale`` a float.
- ``offset``, the causal offset (``kernels/masks.py``), describes visibility,
  never a dense mask: ``None`` = every key of the block is visible to every
  row; an ``int`` ``c`` = key ``j`` (0-based in the block handed over) is
  visible to row ``i`` (0-based in ``q``) iff ``j <= i + c``. The walk
  guarantees ``max(0, B - rows) <= c < B - 1``: every row sees key 0, the
  last row sees the last key, and ``None`` is used whenever all keys are
  visible. ``masks.keep_mask`` builds the [rows, B] bool mask from it for
  kernels that want one (its memory grows with the block, never with the
  sequence).
- ``forward(q, key, value, offset, scale) -> (out, lse)``: float32
  ``out`` [b, h, rows, d_v], the block's own softmax-normalized output, and
  float32 ``lse`` [b, h, rows], its log-sum-exp; the caller merges blocks.
- ``backward(q, key, value, offset, scale, d_out, out, lse) -> (dq, dk, dv)``
  shaped like q/key/value, float32 or q's dtype (what the op gives: the walk
  adds dq into its float32 accumulator and pushes dK/dV through the rebuild in
  their own dtype, so a kernel makes no float32 copies of its grads);
  ``out``/``lse`` are the *final*
  (all-block) output and log-sum-exp of these rows, so the block's
  probabilities ``exp(s - lse)`` are exactly the global ones.
  ``d_out`` and ``out`` come in q's dtype, ``lse`` in float32.
- Packed entry (optional): the walk groups the runs per (key block, query
  segment); a kernel with ``forward_runs(q, key, value, runs, scale)`` and
  ``backward_runs(q, key, value, runs, scale, d_out, out, lse)`` gets all of
  one segment's runs against the block in one call, with ``q``/``d_out``/
  ``out``/``lse`` the *whole* local tensors, ``key``/``value`` the whole
  block, and ``runs`` the walk's ``[(rows, key slice, offset)]`` (disjoint
  rows in order, one run per document the segment crosses in the block).
  They return one ``(out, lse)`` / ``(dq, dk, dv)`` per run, shaped and typed
  as ``forward``/``backward`` would for ``q[:, :, rows]``, ``key[:, :, ks]``,
  so the walk merges and accumulates them the same way. Kernels without it
  (eager, fused) get one ``forward``/``backward`` call per run.
- Key padding (optional keyword ``pad`` of ``forward``/``backward``, [b, keys] bool,
  True = padding key of the slice handed over): those keys are invisible too. A row
  may then see no key of the block: its ``out`` is zero and its ``lse`` ``-inf``
  (the merge skips it), and its grads are zero; a row that sees no key at all has a
  final ``lse`` of ``-inf``. The walk never uses the packed entry with padding.
- Kernels are stateless classes called as ``Kernel.forward(...)`` (static or
  class methods) and never see the sequence length. The walk picks one with
  the kernel object the setup resolved (``Kernel.block``, ``kernels/base.py``):
  each backend keeps its block kernel beside its dense one in its own
  ``kernels/<backend>.py`` (eager: ``EagerBlock``, sdpa: ``FusedBlock``, npu:
  ``NpuBlock``).
"""
from __future__ import annotations

from .registry import kernel_for


def block_kernel(name: str, pad_v: bool = False):
    """The block kernel of the kernel called ``name``, ``pad_v`` bound (NPU only). Each
    block kernel lives in its backend's module; this one asks the registry, so the
    contract imports no backend."""
    return kernel_for(name, pad_v).block



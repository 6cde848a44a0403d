"""Cost model: what each MLA form moves, keeps and computes, per layer and per CP rank.

Pure Python (no torch). For MLA dims, sequence length S, micro-batch b, CP
size P, TP size, cp_algo, dtype and attention kernel it gives, for explicit,
absorbed, LAGA and LAGA's options, forward and backward:

- ``comm``: every collective with the byte counter's two measures
  (``payload`` = this rank's sequence-sharded tensor handed to the
  collective; ``wire`` = the bytes this rank sends: ring all-gather /
  reduce-scatter ``(P-1) * payload``, all-to-all ``payload * (P-1)/P``) and
  the paper's ``payload * (P-1)/P`` (docs/DESIGN.md, section 'Communication'). Equal to ``comm.count_bytes``
  exactly (tests/tools/test_costmodel.py).
- ``saved``: activation bytes autograd keeps for backward inside the
  attention call, one named term per tensor *storage* (a view keeps its whole
  storage alive, so storages are counted once; ``kv_up_weight`` is a
  parameter and is excluded). Written from what *this* implementation saves,
  kernel by kernel, and checked against ``saved_tensors_hooks`` measurements.
- ``peak``: predicted peak memory of the call above its inputs, named terms:
  ``saved`` + ``output`` + the largest transient (kernel workspace, backward
  buffers, or the blockwise path's tile and row-block accumulators); an
  estimate, put beside the measured peak by ``measure.peak_check``:
  ``max_memory_allocated`` on CUDA/NPU, the CPU allocator's events on CPU
  (``cpu_peak.py``; tests compare them on CPU, and on CUDA where there is one).
- ``flops``: attention (Q.K^T and P.V; ``executed`` = the rectangles our
  segment recipe runs, masked keys included, which is what
  ``FlopCounterMode`` counts; ``visible`` = causal pairs (within
  documents) only, the floor of a causal fused kernel) and the K/V
  up-projection ("rebuild"; for absorbed the q.W_UK and o_latent.W_UV
  products that replace it).

Packed documents (``Config.doc_lens``, cu_seqlens = ``Config.documents``): a
query sees only its own document; the pairs, the keys trimming rebuilds and
the kernels' masks follow (``geometry``), the collectives do not change.

Kernels (``Config.kernel``; the names are ``config.MODEL_KERNELS``):

- ``eager``: kernels/eager.py; the score matrix is materialized and kept.
- ``fused``: a flash-style kernel (no score matrix): q, K, V, the output and
  a float32 log-sum-exp per query row are kept; causal masking is in-kernel.
- ``npu``: ``npu_fusion_attention``: as ``fused`` but the softmax max and sum
  are [b, h, s_q, 8] float32 each, plus the shared 2048x2048 compressed mask.
- ``sdpa``: torch SDPA *on CPU*, resolved per form: its flash kernel
  (``sdpa_flash`` = ``fused`` plus the float attn_mask it builds for every
  bottom-right-aligned causal segment) when the q/k head dim equals the v
  head dim, else its math fallback (``sdpa_math``: scaled q and K copies and
  the probabilities kept, in float32 for half inputs). MLA's 192/128 and the
  absorbed form's 576/512 always take the math path on CPU.

Recomputing LAGA (``recompute_kv``) runs its own blockwise kernels; its saved
set does not depend on the kernel.

One concern per module: ``config`` (what is asked, presets, validation),
``geometry`` (segments, visible keys, pairs: closed form, constant time in S),
``comm`` (collectives per form and cp_algo: one table), ``memory`` (saved
storages), ``peak`` (peak memory terms), ``flops``, ``summary`` (per rank and over the CP
group, typed), ``time`` (the per-layer time estimate), ``cluster`` (nodes, the intra- and
inter-node link, hybrid CP's time), ``dsa`` (sparse MLA's collectives: the host's DSA
paths against LAGA's one gather; ``plan --dsa``), ``dsa_ring`` (sparse MLA under a ring or
hybrid split against the one gather: why LAGA refuses those for DSA). Hybrid CP is ``Config(cp_algo="hybrid",
ulysses_degree=U)``; it stays out of ``CP_ALGOS`` (what the tables enumerate). Variants are
:class:`tools.runspec.RunSpec`.
"""
from __future__ import annotations

# What the CLI, the bench and the tests call; the rest stays in its module
# (``costmodel.geometry``, ``costmodel.cluster``, ...).
from .cluster import CLUSTERS, Cluster, estimate_cluster_seconds, ulysses_fits_node
from .config import EAGER, FUSED, NPU, PRESETS, SDPA, Config, doc_lens_for, preset, validate, with_
from .summary import comm_by_group, config_summary, form_cost, rank_summary, summarize
from .time import MACHINES, Machine, estimate_seconds

__all__ = [
    "Config", "PRESETS", "preset", "validate", "with_", "doc_lens_for",  # what is asked
    "EAGER", "FUSED", "NPU", "SDPA",                                     # the model's kernel kinds
    "form_cost", "summarize", "rank_summary", "config_summary", "comm_by_group",  # costs
    "Machine", "MACHINES", "estimate_seconds",                           # one node's time
    "Cluster", "CLUSTERS", "estimate_cluster_seconds", "ulysses_fits_node",  # nodes, two links
]

"""Cost model: what each MLA form moves, keeps and computes, per layer and per CP rank.

Pure Python (no torch). For MLA dims, sequence length S, micro-batch b, CP
size P, TP size, cp_algo, dtype and attention kernel it gives, for explicit,
absorbed, LAGA and LAGA's options, forward and backward:

- ``comm``: every collective with the byte counter's two measures
  (``payload`` = this rank's sequence-sharded tensor handed to the
  collective; ``wire`` = the bytes this rank sends: ring all-gather /
  reduce-scatter ``(P-1) * payload``, all-to-all ``payload * (P-1)/P``) and
  the paper's ``payload * (P-1)/P`` (docs/DESIGN.md, section 'Communication'). Equal to ``comm.count_bytes``
  exactly (tests/test_costmodel.py).
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
inter-node link, hybrid CP's time). Hybrid CP is ``Config(cp_algo="hybrid",
ulysses_degree=U)``; it stays out of ``CP_ALGOS`` (what the tables enumerate). Variants are
:class:`runspec.RunSpec`.
"""
from __future__ import annotations

from ..runspec import RunSpec, standard_runs
from ...vocab.names import CP_ALGOS, DEFAULT_LAYOUT, FORMS, LAYOUTS
from ...vocab.dims import ModelDims
from .comm import EXCHANGES, HYBRID_EXCHANGES, Collective, collectives, wire_bytes
from .config import (BLOCKWISE, DTYPE_BYTES, EAGER, FUSED, HALF, INDEX_BYTES, MODEL_KERNELS, NPU, NPU_MASK_BYTES, PRESETS, RECOMPUTING_KINDS, SDPA, SDPA_FLASH, SDPA_MATH, Config, Sizes, check_doc_lens, doc_lens_for, model_kernel_kind, preset, validate, with_)
from .flops import Flops, flops, query_projection_flops
from .geometry import (Pairs, QuerySegment, attention_pairs, block_keys, blockwise_pairs, blockwise_rebuilds, key_ranges, largest_row_block, query_segments, rebuilt_keys, run_visible_pairs, segment_visible_pairs, visible_keys, window_block_pairs)
from .memory import Term, saved_terms
from .peak import peak_terms
from .summary import (FormCost, RankSummary, comm_by_group, config_summary, form_cost, kernel_kind, rank_summary, summarize)
from .time import MACHINES, Machine, TimeEstimate, estimate_seconds
from .cluster import (CLUSTERS, Cluster, ClusterTime, collective_seconds, estimate_cluster_seconds, group_members, group_nodes, link_bytes, ulysses_fits_node)

# The kernel names the model knows (a superset of what plan offers).
KERNELS = MODEL_KERNELS


def standard_variants(block_size=None):
    """The three forms and LAGA's options as ``plan`` tabulates them."""
    return standard_runs(block_size)


__all__ = [
    # variants and vocabulary
    "RunSpec", "standard_runs", "standard_variants", "CP_ALGOS", "DEFAULT_LAYOUT", "FORMS", "LAYOUTS",
    "ModelDims",
    # what is asked
    "Config", "Sizes", "PRESETS", "preset", "validate", "with_", "DTYPE_BYTES", "HALF", "INDEX_BYTES",
    "NPU_MASK_BYTES", "KERNELS", "MODEL_KERNELS", "RECOMPUTING_KINDS", "EAGER", "FUSED", "NPU", "SDPA",
    "SDPA_FLASH", "SDPA_MATH", "BLOCKWISE", "model_kernel_kind", "doc_lens_for", "check_doc_lens",
    # geometry
    "QuerySegment", "Pairs", "query_segments", "visible_keys", "rebuilt_keys", "block_keys",
    "attention_pairs", "segment_visible_pairs", "blockwise_pairs", "key_ranges", "run_visible_pairs",
    "window_block_pairs", "blockwise_rebuilds", "largest_row_block",
    # costs
    "Collective", "EXCHANGES", "collectives", "wire_bytes", "Term", "saved_terms", "peak_terms",
    "Flops", "flops",
    "query_projection_flops", "FormCost", "RankSummary", "form_cost", "kernel_kind", "summarize",
    "rank_summary", "config_summary", "Machine", "MACHINES", "TimeEstimate", "estimate_seconds",
    # hybrid CP on nodes with two links
    "HYBRID_EXCHANGES", "comm_by_group", "Cluster", "CLUSTERS", "ClusterTime", "group_members",
    "group_nodes",
    "ulysses_fits_node", "link_bytes", "collective_seconds", "estimate_cluster_seconds",
]

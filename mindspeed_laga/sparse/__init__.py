"""Sparse MLA (DSA: DeepSeek-V3.2, GLM-5) under context parallelism: one gather per layer.

- ``form.py``: ``sparse_laga_attention``, the call (gather, then the three stages);
- ``checks.py``: its one validation entry, ``check(...)`` -> a typed setup, and the
  values ranks agree on (``agreed_values``);
- ``indexer.py``: the lightning indexer's math (scores, deterministic top-k, KL loss);
- ``stage.py``: the stage kernels' contract (the call they serve, their results, their
  typed dims and declared capabilities);
- ``registry.py``: the one list of stage kernels;
- ``torch_stages.py``, ``npu_stages.py``: the stage kernels (each names the host flag
  selecting it), and the torch math they share (``absorbed.py``);
- ``op_calls.py``: the fused ops' calls per run of queries (BSND, or TND with documents).

Imports go one way: form -> checks -> registry -> kernels -> op_calls / stage / indexer /
absorbed; no kernel imports another kernel or the form. Importing this package imports no
torch; its names below do.
"""
from ..lazy import lazy

_API = {"SparseResult": ".form", "sparse_laga_attention": ".form"}

__all__ = list(_API)


__getattr__ = lazy(__name__, _API)

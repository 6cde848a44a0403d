"""What the sparse MLA (DSA) kernels share: the call they serve and the stages' results.

A sparse kernel offers three stages, each run on this rank's queries against the keys of
the one packed gather (``sparse/form.py``):

- ``topk(call, index_query, index_weights, index_topk) -> TopK``: the indexer's picks
  (global key positions, -1: no key) and its scores at them, with their gradient;
- ``attend(call, query, kv_up_weight, picks, keep) -> Attended``: the absorbed attention
  over the picks; ``keep`` names what the loss stage reads (a :class:`LossReads`, or None);
- ``loss(call, attended, picks, index_query, index_weights, coeff, tp_group)``: the
  indexer's KL loss, this rank's mean over its query rows, times ``coeff``.

A kernel declares, as class attributes, its ``name`` (the one place a kernel's name is
written; ``sparse/registry.py`` lists the classes), what its loss stage reads from the
attention (``loss_reads``) and whether its loss takes the ``all_keys`` target
(``supports_all_keys``) and, per stage, the host flag that selects it there
(``host_flags``); :meth:`SparseKernel.check` says whether it runs a stage at the call's
:class:`SparseDims`. Kernels import this module and the shared math (``sparse/indexer.py``,
``sparse/absorbed.py``), never the form and never another kernel.
"""
from __future__ import annotations

from enum import Enum
from typing import ClassVar, Dict, List, NamedTuple, Optional

import torch


class LossReads(str, Enum):
    """What a loss stage reads from the attention: an :class:`Attended` field."""
    PROBS = "probs"   # the probabilities at the picks
    STATS = "stats"   # the absorbed inputs and softmax statistics (:class:`AbsorbedStats`)


class Chunk(NamedTuple):
    """A run of this rank's queries with consecutive global positions, inside one document
    when the call has documents."""
    start: int    # its first local query row
    length: int
    key_end: int  # one past its last query's position: it sees the keys [key_start, key_end)
    key_start: int = 0  # the first position of its queries' document (0: no documents)


class SparseCall(NamedTuple):
    """The gathered keys (position order) and what every stage reads besides its inputs."""
    latent: torch.Tensor     # [S, b, d_c]
    k_pe: torch.Tensor       # [S, b, d_r]
    index_key: Optional[torch.Tensor]  # [S, b, D]; None with given picks (no indexer)
    query_pos: torch.Tensor  # [s] global positions of this rank's queries
    chunks: List[Chunk]
    softmax_scale: float
    qk_head_dim: int
    v_head_dim: int
    # [s] the first position of each query's document: a query sees only keys at positions
    # in [query_start, query_pos] (None: no documents, every key up to its own position)
    query_start: Optional[torch.Tensor] = None


class AbsorbedStats(NamedTuple):
    """The absorbed attention's inputs and softmax statistics, detached, layout BSND
    (what the fused KL loss recomputes the attention from)."""
    query: torch.Tensor          # [b, s, n, d_c]: q_nope @ W_UK per head
    query_rope: torch.Tensor     # [b, s, n, d_r]
    softmax_max: torch.Tensor    # [b, 1, s, n] float32
    softmax_sum: torch.Tensor    # [b, 1, s, n] float32: sum of exp(score - softmax_max)


class Attended(NamedTuple):
    output: torch.Tensor                   # [s, b, n*d_v]
    probs: Optional[torch.Tensor] = None   # [b, n, s, k] at the picks, detached
    stats: Optional[AbsorbedStats] = None


class SparseDims(NamedTuple):
    """The sizes a stage kernel may be limited to (the fused ops take a few only)."""
    kv_latent: int    # kv_latent's last dim (kv_lora_rank)
    k_pos_emb: int    # k_pos_emb's last dim (the rope head dim)
    index_key: int    # index_key's last dim (the index head dim)
    heads: int        # this rank's query heads
    loss_heads: int   # the loss's query heads: every head of loss_tp_group
    index_heads: int
    index_topk: int


STAGES = ("indexer", "attention", "loss")


class SparseKernel:
    """Base of the sparse kernels (module docstring): the three stages."""

    name = ""              # its name in the sparse_laga_attention arguments
    loss_reads: ClassVar[Optional[LossReads]] = None  # what its loss stage reads
    # stage -> the host flag (its argparse dest, or the FSDP2 YAML key) that selects this
    # kernel for that stage; none: the host selects it only as the default (the registry's
    # first kernel, selected where no registered kernel's flag is on)
    host_flags: ClassVar[Dict[str, str]] = {}
    supports_all_keys = False  # its loss takes loss_target="all_keys" (loss_all_keys)
    rounds_index_scores = False  # its top-k scores are rounded below the inputs' precision
    loss_reads_index_scores = True  # its loss reads the top-k's scores (else recomputes them)
    kl_eps = 0.0  # what its loss adds to both distributions before the KL's log

    def check(self, stage: str, argument: str, dims: SparseDims) -> None:
        """Raise ValueError naming ``argument`` if this kernel cannot run ``stage``
        (one of STAGES) at these dims; no collective runs."""

    def topk(self, call: SparseCall, index_query, index_weights, index_topk: int):
        raise NotImplementedError

    def attend(self, call: SparseCall, query, kv_up_weight, picks, keep: Optional[str]) -> Attended:
        raise NotImplementedError

    def loss(self, call: SparseCall, attended: Attended, picks, index_query, index_weights,
             coeff: float, tp_group):
        raise NotImplementedError

    def loss_all_keys(self, call: SparseCall, query, kv_up_weight, picks, index_query,
                      index_weights, coeff: float, tp_group):
        """The loss against the ``all_keys`` target (``sparse_laga_attention``'s
        ``loss_target``); only a kernel declaring ``supports_all_keys`` runs it."""
        raise NotImplementedError

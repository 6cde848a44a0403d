"""MindSpeed-LLM's FSDP2 backend (26.1.0, ``train_fsdp2.py``): what its context parallelism
hands the wire per token and layer, forward, against LAGA's, and the tensors with two dims
of the full sequence its GLM path makes on every rank.

- HF DeepSeek-V3 (``deepseek_v3``): the host's common attention over per-head Q/K/V is the
  explicit form of the CP algorithm LAGA maps its ``parallel.cp_type`` to (``CP_TYPES``):
  ``ulysses`` moves Q, K, V and O by all-to-all, ``ring`` passes each rank's per-head K and V
  around the ring (P-1 sends of the local payload, the bytes of an all-gather). LAGA's rows
  are the same algorithm's ``laga`` exchanges (``cp_algos/``).
- GLM-5/5.2 (``glm_moe_dsa``): the host's CP table maps the model to ``dsa_forward`` under
  either ``cp_type``. It all-gathers each token's hidden state, query latent, cos and sin,
  moves per-head Q, K, V and O by all-to-all, and builds a dense ``[b, S, S]`` additive mask
  in the attention's dtype from the picks, then a boolean copy of it for the fused attention;
  transformers' indexer scores ``[b, S, index heads, S]`` in float32. LAGA's sparse form
  gathers ``[kv_latent | k_pos_emb | index_key]`` (``dsa.laga``), ``[kv_latent | k_pos_emb]``
  on a layer reusing the picks (``dsa.laga_reusing``), and keeps nothing of size S_local x S.
"""
from __future__ import annotations

from typing import Optional

from ...cp_algos import algo
from ...vocab.dims import ModelDims
from . import dsa
from .dsa import ALL_GATHER, ALL_TO_ALL, DSAPath, Transfer
from .model_dims import IndexerDims, IndexShare

CP_TYPES = {"ulysses": "ulysses", "ring": "allgather"}  # parallel.cp_type -> LAGA's cp_algo
RING_SEND = "ring_send"   # the host's ring attention: P-1 point-to-point steps of the payload
SPLIT = {"ulysses": 1, "ring": 2}  # the host's sequence split: P slices, or 2P zigzag chunks
SPARSE_ALGO = "allgather"  # LAGA's sparse form: one gather under either cp_type, queries local
SCORE_BYTES = 4  # transformers' indexer scores in float32


def dense_paths(dims: ModelDims, cp_type: str):
    """(host, LAGA) for HF DeepSeek-V3 under ``cp_type``, forward (TP 1: every head)."""
    cp_algo = algo(CP_TYPES[cp_type])
    host_kind = RING_SEND if cp_type == "ring" else None

    def transfers(form, kind=None):
        return tuple(Transfer(kind or e.kind, e.tag, e.width)
                     for e in cp_algo.exchanges(form, dims, dims.heads))
    return (DSAPath(f"host {cp_type}", transfers("explicit", host_kind), ()),
            DSAPath(f"laga {cp_algo.name}", transfers("laga"), ()))


def host_glm(dims: ModelDims) -> DSAPath:
    """The host's ``dsa_forward``: four gathers, then Ulysses over per-head Q/K/V/O."""
    qk = dims.heads * (dims.qk_head_dim + dims.rope_dim)
    out = dims.heads * dims.v_head_dim
    gathers = (Transfer(ALL_GATHER, "hidden state", dims.hidden_size),
               Transfer(ALL_GATHER, "query latent (q_lora_rank)", dims.q_lora_rank),
               Transfer(ALL_GATHER, "cos", dims.rope_dim), Transfer(ALL_GATHER, "sin", dims.rope_dim))
    heads = (Transfer(ALL_TO_ALL, "Q", qk), Transfer(ALL_TO_ALL, "K", qk),
             Transfer(ALL_TO_ALL, "V", out), Transfer(ALL_TO_ALL, "O", out))
    return DSAPath("host dsa_forward", gathers + heads, ())


def glm_paths(dims: ModelDims, index: IndexerDims):
    """(host, LAGA computing its picks, LAGA reusing them), forward."""
    return (host_glm(dims), DSAPath("laga", dsa.laga(dims, index).forward, ()),
            DSAPath("laga, reusing picks", dsa.laga_reusing(dims).forward, ()))


def host_squares(seq_len: int, micro_batch: int, index: IndexerDims, elem: int) -> dict:
    """Bytes of each tensor with two dims of the full sequence the host's GLM path makes on a
    rank: the additive mask, its boolean copy (alive together: the mask's peak) and the
    indexer's scores."""
    square = micro_batch * seq_len * seq_len
    mask, copy = square * elem, square
    return {"index_mask": mask, "index_mask_bool": copy, "mask_peak": mask + copy,
            "indexer_scores": square * index.heads * SCORE_BYTES}


def _row(path: DSAPath, tokens: int, cp_size: int, elem: int) -> dict:
    return {"collectives": len(path.forward), "values_per_token": path.values("forward"),
            "received_bytes": dsa.received_bytes(path, "forward", tokens, cp_size, elem),
            "transfers": [vars(t) for t in path.forward]}


def check_split(seq_len: int, cp_size: int, cp_type: str) -> None:
    parts = SPLIT[cp_type] * cp_size
    if seq_len % parts:
        raise ValueError(f"--seq-len {seq_len} must be a multiple of {parts} (--cp-type {cp_type} "
                         f"splits the sequence into {parts} equal parts at --cp {cp_size})")


def fsdp2_table(dims: ModelDims, seq_len: int, cp_size: int, micro_batch: int, elem: int,
                cp_type: str, index: Optional[IndexerDims] = None,
                share: Optional[IndexShare] = None) -> dict:
    """Host against LAGA, forward, per layer and per CP rank (JSON-able); with ``index`` the
    GLM path, its layer mix (``share``) and the host's sequence-square tensors."""
    if cp_type not in CP_TYPES:
        raise ValueError(f"--cp-type {cp_type!r} is not the FSDP2 backend's; use ulysses or ring")
    check_split(seq_len, cp_size, cp_type)
    tokens = seq_len // cp_size * micro_batch
    paths = dense_paths(dims, cp_type) if index is None else glm_paths(dims, index)
    table = {"seq_len": seq_len, "cp_size": cp_size, "micro_batch": micro_batch, "elem_bytes": elem,
             "cp_type": cp_type, "laga_cp_algo": CP_TYPES[cp_type] if index is None else SPARSE_ALGO,
             "paths": {p.name: _row(p, tokens, cp_size, elem) for p in paths}}
    if index is not None:
        table.update(index_heads=index.heads, index_head_dim=index.head_dim,
                     host_squares=host_squares(seq_len, micro_batch, index, elem), laga_squares=0)
        if share is not None:
            table["layer_mix"] = dsa.layer_mix(dims, index, share)
    return table

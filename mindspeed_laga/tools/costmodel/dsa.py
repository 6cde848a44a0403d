"""Sparse MLA (DSA: DeepSeek-V3.2, GLM-5, GLM-5.2): what each CP path moves per token and layer.

DSA's attention is absorbed MQA over the latent, picked per query by a lightning
indexer (index heads x index head dim, one shared index key per token). Three paths,
each a list of collectives with its per-token width, every width derived from the dims
(read from MindSpeed-LLM's ``tasks/models/transformer/dsa_indexer.py`` and
``multi_latent_attention.py``):

- ``host kvallgather`` (the absorbed, fused path ``kvallgather_cp_algo`` takes): seven
  all-gathers a layer: the index key for the indexer's top-k
  (``fused_lightning_indexer_kvallgather``), the latent as K, the same latent again as V
  and k_rope for the sparse attention (``fused_sparse_flash_attention_kvallgather``),
  and the latent, the index key and k_rope again for the indexer's KL loss
  (``fused_sparse_lightning_indexer_kl_loss_kvallgather``). Backward, a reduce-scatter
  for each gather that has a gradient: K, V and k_rope of the attention and the loss's
  index key (the indexer's top-k runs without grad; the loss op returns no grad for its
  latent or k_rope).
- ``host ulysses`` (the non-absorbed path of ``ulysses_cp_algo``): the indexer gathers
  its query (index heads x index dim), its key and the hidden state
  (``forward_with_index``); Q, K, V and the output go all-to-all (heads x (d_n + d_r)
  for Q and K, heads x d_v for V and O); the loss gathers the per-head query and key
  again (``get_attn_scores`` after the core attention). Backward: the indexer's three
  gathers reduce-scatter (the loss reaches the index projections through them), the
  four all-to-alls run again; the loss's gathers carry no grad (they are detached).
- ``laga``: one all-gather of ``[kv_latent | k_pos_emb | index_key]`` serving the
  indexer, the attention and the loss; backward, its reduce-scatter. A layer that reuses
  an earlier layer's picks (GLM-5.2's index share, :class:`IndexShare`) gathers
  ``[kv_latent | k_pos_emb]`` only: :func:`layer_mix` counts the layers of each kind.

Widths are values per token (TP 1: the head-split tensors hold every head). What a rank
receives of a collective is the byte counter's ``wire`` (``comm.wire_bytes``): an
all-gather or reduce-scatter ``(P-1) x`` the local payload, an all-to-all ``(P-1)/P x``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from ...vocab.dims import ModelDims
from .comm import wire_bytes
from .model_dims import IndexerDims, IndexShare  # noqa: F401
from .presets import DSA_PRESETS, DSA_SHARES, dsa_preset  # noqa: F401  (the one registry)

ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL = "all_gather", "reduce_scatter", "all_to_all"


def layer_mix(dims: ModelDims, index: IndexerDims, share: IndexShare) -> dict:
    """How many layers compute their picks (gathering the index key too) and how many
    reuse them, with each kind's LAGA gather width and the mean over the layers."""
    computing = sum(share.computes(layer) for layer in range(1, share.num_layers + 1))
    widths = {"computing": laga(dims, index).values("forward"),
              "reusing": laga_reusing(dims).values("forward")}
    reusing = share.num_layers - computing
    mean = (computing * widths["computing"] + reusing * widths["reusing"]) / share.num_layers
    return {"freq": share.freq, "offset": share.offset, "layers": share.num_layers,
            "computing": computing, "reusing": reusing, "values_per_token": widths,
            "mean_values_per_token": mean}


@dataclass(frozen=True)
class Transfer:
    """One collective: what it carries and its width in values per token."""
    kind: str
    what: str
    width: int


@dataclass(frozen=True)
class DSAPath:
    name: str
    forward: Tuple[Transfer, ...]
    backward: Tuple[Transfer, ...]

    def values(self, direction: str) -> int:
        return sum(t.width for t in getattr(self, direction))


def host_kvallgather(dims: ModelDims, index: IndexerDims) -> DSAPath:
    latent, rope, key = dims.kv_lora_rank, dims.rope_dim, index.head_dim
    k = Transfer(ALL_GATHER, "latent as K (attention)", latent)
    v = Transfer(ALL_GATHER, "latent as V (attention)", latent)
    k_rope = Transfer(ALL_GATHER, "k_rope (attention)", rope)
    loss_key = Transfer(ALL_GATHER, "index key (loss)", key)
    forward = (Transfer(ALL_GATHER, "index key (indexer top-k)", key), k, v, k_rope,
               Transfer(ALL_GATHER, "latent (loss)", latent), loss_key,
               Transfer(ALL_GATHER, "k_rope (loss)", rope))
    return DSAPath("host kvallgather", forward, tuple(_backward(t) for t in (k, v, k_rope, loss_key)))


def host_ulysses(dims: ModelDims, index: IndexerDims) -> DSAPath:
    qk = dims.heads * (dims.qk_head_dim + dims.rope_dim)
    out = dims.heads * dims.v_head_dim
    indexer = (Transfer(ALL_GATHER, "index query (indexer)", index.heads * index.head_dim),
               Transfer(ALL_GATHER, "index key (indexer)", index.head_dim),
               Transfer(ALL_GATHER, "hidden state (indexer)", _hidden(dims)))
    heads = (Transfer(ALL_TO_ALL, "Q", qk), Transfer(ALL_TO_ALL, "K", qk), Transfer(ALL_TO_ALL, "V", out),
             Transfer(ALL_TO_ALL, "O", out))
    loss = (Transfer(ALL_GATHER, "per-head query (loss)", qk),
            Transfer(ALL_GATHER, "per-head key (loss)", qk))
    return DSAPath("host ulysses", indexer + heads + loss, tuple(_backward(t) for t in indexer + heads))


def laga(dims: ModelDims, index: IndexerDims) -> DSAPath:
    gather = Transfer(ALL_GATHER, "[kv_latent | k_pos_emb | index_key]",
                      dims.kv_lora_rank + dims.rope_dim + index.head_dim)
    return DSAPath("laga", (gather,), (_backward(gather),))


def laga_reusing(dims: ModelDims) -> DSAPath:
    """A layer with given picks: no indexer, no loss, no index key to gather."""
    gather = Transfer(ALL_GATHER, "[kv_latent | k_pos_emb]", dims.kv_lora_rank + dims.rope_dim)
    return DSAPath("laga, reusing picks", (gather,), (_backward(gather),))


def _hidden(dims: ModelDims) -> int:
    if dims.hidden_size is None:
        raise ValueError("the host's ulysses DSA path gathers the hidden state: give --hidden-size")
    return dims.hidden_size


def _backward(t: Transfer) -> Transfer:
    return Transfer(REDUCE_SCATTER if t.kind == ALL_GATHER else t.kind, t.what, t.width)


def dsa_paths(dims: ModelDims, index: IndexerDims) -> List[DSAPath]:
    return [host_kvallgather(dims, index), host_ulysses(dims, index), laga(dims, index)]


def reusing_paths(dims: ModelDims, index: IndexerDims) -> List[DSAPath]:
    """Each path in a layer that reuses an earlier layer's picks: the host builds no indexer
    there (an ``IdentityOp``, ``_skip_dsa_topk``), so neither the indexer's top-k nor its
    loss runs: only the attention's collectives are left; LAGA's is :func:`laga_reusing`."""
    def attention_only(path: DSAPath) -> DSAPath:
        def keep(t):
            return t.kind == ALL_TO_ALL or t.what.endswith("(attention)")
        return DSAPath(path.name, tuple(filter(keep, path.forward)), tuple(filter(keep, path.backward)))
    return [attention_only(host_kvallgather(dims, index)), attention_only(host_ulysses(dims, index)),
            DSAPath("laga", laga_reusing(dims).forward, laga_reusing(dims).backward)]


def received_bytes(path: DSAPath, direction: str, tokens_per_rank: int, cp_size: int, elem: int) -> int:
    """Bytes one rank receives (= sends) in ``direction`` for one layer."""
    return sum(wire_bytes(t.kind, tokens_per_rank * t.width * elem, cp_size)
               for t in getattr(path, direction))


def path_row(path: DSAPath, tokens_per_rank: int, cp_size: int, elem: int) -> dict:
    """One path's collectives, values per token and bytes a rank receives, per direction."""
    return {d: {"collectives": len(getattr(path, d)), "values_per_token": path.values(d),
                "received_bytes": received_bytes(path, d, tokens_per_rank, cp_size, elem),
                "transfers": [vars(t) for t in getattr(path, d)]}
            for d in ("forward", "backward")}


def dsa_table(dims: ModelDims, index: IndexerDims, seq_len: int, cp_size: int, micro_batch: int,
              elem: int, share: IndexShare = None) -> dict:
    """Every path's collectives, values per token and bytes per rank and layer (JSON-able);
    with ``share``, LAGA's mix of computing and reusing layers (``layer_mix``)."""
    if seq_len % cp_size:
        raise ValueError(f"--seq-len {seq_len} must be a multiple of --cp {cp_size}")
    tokens = seq_len // cp_size * micro_batch
    rows = {path.name: path_row(path, tokens, cp_size, elem) for path in dsa_paths(dims, index)}
    table = {"seq_len": seq_len, "cp_size": cp_size, "micro_batch": micro_batch, "elem_bytes": elem,
             "index_heads": index.heads, "index_head_dim": index.head_dim, "paths": rows}
    if share is not None:
        table["layer_mix"] = layer_mix(dims, index, share)
        table["reusing_paths"] = {p.name: path_row(p, tokens, cp_size, elem)
                                  for p in reusing_paths(dims, index)}
    return table

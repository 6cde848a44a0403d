"""The sparse call's one validation entry: every argument checked, a typed setup returned.

:func:`check` raises ValueError naming the argument (and the fix) for anything the call
cannot run, from what this rank holds alone, so it runs no collective. What ranks must
agree on beyond that (the same options and shapes on every rank) is
:func:`agreed_values`: the integers the cross-rank agreement compares. :func:`check_call`
runs both, the agreement through the dense forms' protocol (mindspeed_laga/agreement/:
an exchange on the first call of a micro-batch, a digest folded on the others), so ranks
that disagree, or a rank whose check failed, raise together before the gather.
"""
from __future__ import annotations

import math
import numbers
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from .. import agreement, comm
from ..agreement import inband
from ..checks import check_cu_seqlens  # the dense forms' documents check
from ..vocab.names import LAYOUTS as ALL_LAYOUTS
from ..vocab.segments import Documents
from .registry import SPARSE_KERNELS, SparseStages, kernel_index, sparse_stages
from .stage import SparseDims

LAYOUTS = ("contiguous", "zigzag")
LOSS_TARGETS = ("picks", "all_keys")
# the call's tensors in requires-grad bit order (bit i: input i needs a gradient)
INPUTS = ("query", "kv_latent", "k_pos_emb", "kv_up_weight", "index_query", "index_key",
          "index_weights")
# what a call with given picks (topk_indices) needs none of: it runs no indexer
INDEX_INPUTS = INPUTS[4:]
PICK_DTYPES = (torch.int32, torch.int64)


class SparseOptions(NamedTuple):
    """sparse_laga_attention's keyword arguments, as given."""
    index_topk: int
    softmax_scale: float
    qk_head_dim: int
    v_head_dim: int
    cp_group: object = None
    layout: str = "zigzag"
    indexer_loss_coeff: Optional[float] = None
    indexer_kernel: str = "torch"
    attention_kernel: str = "torch"
    loss_kernel: str = "torch"
    loss_tp_group: object = None
    loss_target: str = "picks"
    cu_seqlens: object = None  # packed documents: the global boundaries 0 ... S, or None


class SparseSetup(NamedTuple):
    """What the call runs, every argument checked."""
    options: SparseOptions
    dims: SparseDims
    stages: SparseStages
    kernels: Tuple[str, str, str]  # (indexer, attention, loss) kernel names
    cp_size: int
    cp_rank: int
    local_len: int
    micro_batch: int
    with_loss: bool
    all_keys: bool  # the loss reads the all_keys target
    documents: Documents = None  # the checked global document boundaries, or None
    given_topk: int = 0  # the k of the given picks (topk_indices); 0: the indexer picks


def check(query, kv_latent, k_pos_emb, kv_up_weight, index_query, index_key, index_weights,
          options: SparseOptions, topk_indices=None) -> SparseSetup:
    """Every argument of the sparse call checked (ValueError naming it); no collective.
    ``topk_indices``: the given picks (a layer reusing another layer's), or None."""
    o = options
    _check_choices(o)
    tensors = (query, kv_latent, k_pos_emb, kv_up_weight, index_query, index_key, index_weights)
    given = topk_indices is not None
    if given:
        _check_given_picks(topk_indices, dict(zip(INPUTS, tensors)), o)
        tensors = tensors[:4]
    _check_tensors(dict(zip(INPUTS, tensors)))
    _check_shapes(*tensors, qk_head_dim=o.qk_head_dim, v_head_dim=o.v_head_dim)
    cp_size = comm.check_group(o.cp_group)
    _check_split(query.shape[0], cp_size, o.layout)
    if given:
        _check_picks_shape(topk_indices, query, o.index_topk)
    loss_group = comm.check_group(o.loss_tp_group, "loss_tp_group")
    dims = SparseDims(kv_latent=kv_latent.shape[-1], k_pos_emb=k_pos_emb.shape[-1],
                      index_key=0 if given else index_key.shape[-1], heads=query.shape[2],
                      loss_heads=query.shape[2] * loss_group,
                      index_heads=0 if given else index_query.shape[2], index_topk=o.index_topk)
    with_loss = o.indexer_loss_coeff is not None
    stages = sparse_stages(indexer_kernel=o.indexer_kernel, attention_kernel=o.attention_kernel,
                           loss_kernel=o.loss_kernel, dims=dims, with_loss=with_loss,
                           with_indexer=not given)
    if o.loss_target == "all_keys" and not stages.loss.supports_all_keys:
        raise ValueError(f"loss_target='all_keys' needs a loss kernel that supports it: "
                         f"loss_kernel={o.loss_kernel!r} does not; use a loss_kernel with "
                         f"supports_all_keys (e.g. loss_kernel='torch') or loss_target='picks'")
    documents = _check_documents(o, query, cp_size)
    return SparseSetup(o, dims, stages, (o.indexer_kernel, o.attention_kernel, o.loss_kernel),
                       cp_size, comm.group_rank(o.cp_group), query.shape[0], query.shape[1],
                       with_loss, with_loss and o.loss_target == "all_keys", documents,
                       topk_indices.shape[-1] if given else 0)


def _check_documents(o: SparseOptions, query, cp_size: int) -> Documents:
    """cu_seqlens checked as the dense forms check it (micro-batch 1, boundaries 0 ... S);
    the all_keys target reads every key of the sequence, which documents do not define."""
    documents = check_cu_seqlens(o.cu_seqlens, query, cp_size, o.layout, cp_group=o.cp_group)
    if documents is not None and o.loss_target == "all_keys" and o.indexer_loss_coeff is not None:
        raise ValueError("loss_target='all_keys' with cu_seqlens is not supported: its target "
                         "is the softmax over every key of the packed sequence, across "
                         "documents; use loss_target='picks' (the attention's own "
                         "probabilities, within the document) or drop cu_seqlens")
    return documents


def check_call(tensors, options: SparseOptions, check_ranks=None,
               topk_indices=None) -> SparseSetup:
    """:func:`check`, then the ranks' agreement on the call (``check_ranks`` as in
    laga_attention); raises this rank's error after its peers learnt of it."""
    cp_size = comm.check_group(options.cp_group)  # alone: no exchange over a non-group
    setup = failure = None
    try:
        if check_ranks is not None and not isinstance(check_ranks, bool):
            raise ValueError(f"check_ranks must be True, False or None, got {check_ranks!r}")
        setup = check(*tensors, options, topk_indices)
    except Exception as exc:  # noqa: BLE001 -- whatever failed, the peers must hear of it
        if cp_size == 1:
            raise
        failure = exc
    if cp_size > 1:
        device = tensors[0].device if isinstance(tensors[0], torch.Tensor) else "cpu"
        documents = list(setup.documents or ()) if setup is not None else []
        agreement.note_weight(tensors[3])
        kind = "sparse_latent" if topk_indices is None else "sparse_latent/given_picks"
        with inband.joined(options.cp_group, kind):
            agreement.agree_call(options.cp_group, check_ranks, failure, device,
                                 lambda: _row(setup, tensors, check_ranks), names=_NAMES,
                                 details={"documents": documents},
                                 values=lambda: agreement.call_tensors(tensors[3], None))
    return setup


_NAMES = {"loss_target": LOSS_TARGETS, "indexer_kernel": SPARSE_KERNELS,
          "attention_kernel": SPARSE_KERNELS, "loss_kernel": SPARSE_KERNELS}


def _row(setup: Optional[SparseSetup], tensors, check_ranks) -> Dict[str, int]:
    """The agreement's row of this call (agreement.FIELDS): the sparse values and the
    shapes the gather and the attention read."""
    row = {"stage": agreement.STAGES.index("sparse_attention"),
           "check_ranks": int(check_ranks is not False)}
    if setup is None:
        return row
    values = agreed_values(setup, tensors)
    values["loss_coeff"] = values.pop("indexer_loss_coeff")
    o = setup.options
    # a hash of the boundaries, once per micro-batch (the later calls pass the same ones)
    row["documents"] = agreement.memo(o.cp_group, ("documents", setup.documents),
                                      lambda: agreement.documents_code(setup.documents))
    row.update(values, softmax_scale=agreement.float_bits(o.softmax_scale),
               heads=setup.dims.heads, qk_head_dim=o.qk_head_dim, v_head_dim=o.v_head_dim,
               rope_dim=setup.dims.k_pos_emb, kv_lora_rank=setup.dims.kv_latent)
    return row


def agreed_values(setup: SparseSetup, tensors) -> Dict[str, int]:
    """What every rank of the CP group must agree on, as integers: ``tensors`` the call's
    seven inputs in INPUTS order. The cross-rank agreement compares these."""
    o, dims = setup.options, setup.dims
    values = {"index_topk": o.index_topk, "index_heads": dims.index_heads,
              "index_head_dim": dims.index_key,
              "loss_target": LOSS_TARGETS.index(o.loss_target),
              "indexer_loss_coeff": (0 if o.indexer_loss_coeff is None
                                     else agreement.float_bits(o.indexer_loss_coeff)),
              "given_topk": setup.given_topk,  # given picks' k, 0: the indexer picks
              "local_len": setup.local_len, "micro_batch": setup.micro_batch,
              "layout": ALL_LAYOUTS.index(o.layout),  # coded as the dense forms code it
              "dtype": agreement.dtype_code(tensors[0].dtype),
              "requires_grad": grad_pattern(tensors)}
    for stage, name in zip(("indexer_kernel", "attention_kernel", "loss_kernel"), setup.kernels):
        values[stage] = kernel_index(name)
    return values


def grad_pattern(tensors) -> int:
    """Which of the seven inputs need a gradient, as bits (0 outside grad mode): a rank
    whose keys need none would skip the backward reduce-scatter its peers wait in."""
    if not torch.is_grad_enabled():
        return 0
    return sum(1 << i for i, t in enumerate(tensors) if t is not None and t.requires_grad)


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _finite(x) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond float range
        return False


def _check_choices(o: SparseOptions) -> None:
    if o.layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} for sparse MLA, got {o.layout!r}")
    if o.loss_target not in LOSS_TARGETS:
        raise ValueError(f"loss_target must be one of {LOSS_TARGETS}, got {o.loss_target!r}")
    if not isinstance(o.index_topk, int) or isinstance(o.index_topk, bool) or o.index_topk < 1:
        raise ValueError(f"index_topk must be a positive int, got {o.index_topk!r}")
    for name in ("qk_head_dim", "v_head_dim"):
        value = getattr(o, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int (the MLA config's), got {value!r}")
    if not _real(o.softmax_scale) or not _finite(o.softmax_scale) or o.softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive, finite real number (e.g. "
                         f"1/sqrt(qk_head_dim + qk_pos_emb_head_dim)), got {o.softmax_scale!r}")
    coeff = o.indexer_loss_coeff
    if coeff is not None and (not _real(coeff) or not _finite(coeff)):
        raise ValueError(f"indexer_loss_coeff must be None (no loss) or a finite real number, "
                         f"got {coeff!r}")


# each input's number of dims
_RANKS = {"query": 4, "kv_latent": 3, "k_pos_emb": 3, "kv_up_weight": 2, "index_query": 4,
          "index_key": 3, "index_weights": 3}


def _check_tensors(named: Dict[str, object]) -> None:
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != _RANKS[name]:
            raise ValueError(f"{name} must have {_RANKS[name]} dims, got shape "
                             f"{list(tensor.shape)}")
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{name} must be floating point, got {tensor.dtype}")
        if tensor.dtype not in agreement.DTYPES:  # float8: no collective or matmul takes it
            raise ValueError(f"{name} of dtype {tensor.dtype} is not supported: sparse MLA "
                             f"runs {[str(d) for d in agreement.DTYPES]}; cast the inputs "
                             "(query, kv_latent, k_pos_emb, kv_up_weight and the index "
                             "tensors) to bfloat16 (float8 recipes keep attention in bf16)")
    devices = {t.device for t in named.values()}
    if any(d.type == "meta" for d in devices):
        raise ValueError(f"inputs on the meta device (got {sorted(map(str, devices))}) have no "
                         "values: materialize the model and run it on a real device")
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    gathered = {n: named[n] for n in ("kv_latent", "k_pos_emb", "index_key") if n in named}
    if len({t.dtype for t in gathered.values()}) != 1:
        raise ValueError(f"{', '.join(gathered)} travel in one gather and must share a dtype, "
                         f"got {', '.join(str(t.dtype) for t in gathered.values())}")


def _check_given_picks(topk_indices, named: Dict[str, object], o: SparseOptions) -> None:
    """A call with given picks runs no indexer: its index inputs and loss must be absent,
    the picks an integer tensor (its shape is checked after the query's)."""
    if not isinstance(topk_indices, torch.Tensor) or topk_indices.dim() != 3:
        raise ValueError("topk_indices must be a [b, s, k] torch.Tensor (the topk_indices of "
                         "an earlier call's SparseResult), got "
                         + (f"shape {list(topk_indices.shape)}"
                            if isinstance(topk_indices, torch.Tensor)
                            else type(topk_indices).__name__))
    if topk_indices.dtype not in PICK_DTYPES:
        raise ValueError(f"topk_indices must be int32 or int64 (global key positions, -1: no "
                         f"key), got {topk_indices.dtype}")
    given = [name for name in INDEX_INPUTS if named[name] is not None]
    if given:
        raise ValueError(f"with topk_indices the call runs no indexer: pass None for "
                         f"{', '.join(given)} (the picks are given)")
    if o.indexer_loss_coeff is not None:
        raise ValueError("with topk_indices the call runs no indexer, so it has no indexer "
                         "loss: pass indexer_loss_coeff=None (the layer that computed the "
                         "picks takes the loss)")


def _check_picks_shape(topk_indices, query, index_topk: int) -> None:
    s, b = query.shape[:2]
    k = topk_indices.shape[-1]
    if tuple(topk_indices.shape[:2]) != (b, s) or not 1 <= k <= index_topk:
        raise ValueError(f"topk_indices must have shape [b, s, k] = [{b}, {s}, k] with "
                         f"1 <= k <= index_topk={index_topk} (this rank's queries, query "
                         f"{list(query.shape)}), got {list(topk_indices.shape)}")
    if topk_indices.device != query.device:
        raise ValueError(f"topk_indices must be on the query's device {query.device}, got "
                         f"{topk_indices.device}")


def _check_split(local_len: int, cp_size: int, layout: str) -> None:
    """The layout's cut of the sequence: zigzag's two equal chunks per rank."""
    if cp_size > 1 and layout == "zigzag" and local_len % 2:
        raise ValueError(
            f"layout='zigzag' needs the sequence divisible by 2*CP={2 * cp_size}: each rank "
            f"holds 2 equal chunks, but this rank holds {local_len} tokens; pad the sequence "
            "to a multiple of 2*CP or use layout='contiguous'")


def _check_shapes(query, kv_latent, k_pos_emb, kv_up_weight, *index_inputs, qk_head_dim,
                  v_head_dim) -> None:
    """Each input's shape against the query's (s, b, n) and the others' last dims
    (``index_inputs``: index_query, index_key, index_weights, or none: given picks)."""
    s, b, n, d_q = query.shape
    d_c, d_r = kv_latent.shape[-1], k_pos_emb.shape[-1]
    expect = {"kv_latent": (kv_latent, (s, b, d_c)), "k_pos_emb": (k_pos_emb, (s, b, d_r)),
              "kv_up_weight": (kv_up_weight, (n * (qk_head_dim + v_head_dim), d_c))}
    if index_inputs:
        index_query, index_key, index_weights = index_inputs
        expect.update({
            "index_key": (index_key, (s, b, index_key.shape[-1])),
            "index_query": (index_query, (s, b, index_query.shape[2], index_key.shape[-1])),
            "index_weights": (index_weights, (s, b, index_query.shape[2]))})
    for name, (tensor, shape) in expect.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} (query {list(query.shape)}), "
                             f"got {list(tensor.shape)}")
    if d_q != qk_head_dim + d_r:
        raise ValueError(f"query's last dim {d_q} must be qk_head_dim {qk_head_dim} + "
                         f"k_pos_emb's {d_r}")

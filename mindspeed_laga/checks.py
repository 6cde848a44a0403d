"""Argument checks shared by the three forms (the row the ranks agree on:
agreement/rows.py).

Every check runs before any data collective. With CP > 1 the ranks then
exchange their verdict and every value that must agree (agreement/wire.py): if
any rank rejected its arguments, or the ranks disagree, *every* rank raises
the ``ValueError`` instead of some ranks waiting forever in a collective or
returning wrong numbers. A local check that fails with another exception
type (a bug, or an input no check foresaw) still reaches the exchange: its
peers raise "rejected" and the rank re-raises its own exception.
"""
from __future__ import annotations

import math
import operator
import numbers
import weakref
from typing import Optional

import torch

from . import agreement, comm, kernels
from .cp_algos import ALGOS, algo
from .agreement.rows import agree_on_call
from .key_padding import check_empty_rows, check_key_padding
from .options import AttnOptions
from .kernels.registry import KERNELS
from .vocab.names import ATTN_CP_ALGOS, LAYOUTS
from .vocab.attn_setup import AttnSetup
from .vocab.dims import MLADims
from .vocab.documents import resolve_documents
from .vocab.segments import seq_multiple


def _dims(query, kv_latent, k_pos_emb, kv_up_weight, qk_head_dim=None, v_head_dim=None) -> MLADims:
    for name, t, nd in (("query", query, 4), ("kv_latent", kv_latent, 3),
                        ("k_pos_emb", k_pos_emb, 3), ("kv_up_weight", kv_up_weight, 2)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != nd:
            raise ValueError(f"{name} must have {nd} dims, got shape {tuple(t.shape)}; "
                             "see the laga_attention docstring for the [s, b, ...] layouts")
    empty = [name for name, t in (("query", query), ("kv_latent", kv_latent),
                                  ("k_pos_emb", k_pos_emb), ("kv_up_weight", kv_up_weight))
             if t.numel() == 0]
    if empty:
        raise ValueError(f"{empty} have a zero-size dimension (query {tuple(query.shape)}, "
                         f"kv_latent {tuple(kv_latent.shape)}, k_pos_emb {tuple(k_pos_emb.shape)}, "
                         f"kv_up_weight {tuple(kv_up_weight.shape)}); every rank needs at least "
                         "one token, one sequence, one head and non-empty head dims")
    s, b, n, q_dim = query.shape
    d_r = k_pos_emb.shape[-1]
    d_c = kv_latent.shape[-1]
    if kv_latent.shape[:2] != (s, b) or k_pos_emb.shape[:2] != (s, b):
        raise ValueError(
            f"query, kv_latent and k_pos_emb must share [s, b]; got {tuple(query.shape[:2])}, "
            f"{tuple(kv_latent.shape[:2])}, {tuple(k_pos_emb.shape[:2])}")
    rows, cols = kv_up_weight.shape
    if cols != d_c:
        raise ValueError(f"kv_up_weight must be [n*(qk_head_dim+v_head_dim), kv_lora_rank={d_c}] "
                         f"(Megatron's linear_kv_up_proj.weight); got {tuple(kv_up_weight.shape)}")
    d_n, d_v = _head_dims(q_dim, d_r, rows, n, qk_head_dim, v_head_dim)
    return MLADims(n, d_n, d_r, d_v, d_c)


def _head_dims(q_dim, d_r, rows, n, qk_head_dim, v_head_dim):
    """(d_n, d_v): checked against the caller's values, or read off the tensors when
    that reading is unique."""
    for name, value in (("qk_head_dim", qk_head_dim), ("v_head_dim", v_head_dim)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    given = qk_head_dim is not None or v_head_dim is not None
    d_n = q_dim - d_r if qk_head_dim is None else qk_head_dim
    if d_n <= 0 or d_n + d_r != q_dim:
        raise ValueError(f"query's last dim ({q_dim}) must be qk_head_dim ({d_n}) + "
                         f"qk_pos_emb_head_dim (k_pos_emb.shape[-1] = {d_r}); check k_pos_emb's "
                         "width and qk_head_dim")
    d_v = v_head_dim if v_head_dim is not None else (rows // n - d_n if rows % n == 0 else -1)
    if d_v <= 0 or rows != n * (d_n + d_v):
        raise ValueError(f"kv_up_weight has {rows} rows; it must be n*(qk_head_dim+v_head_dim) = "
                         f"{n}*({d_n}+{d_v if d_v > 0 else 'v_head_dim'}) for this TP rank's "
                         "heads (the TP-split linear_kv_up_proj.weight, not the whole one)")
    if not given and d_v != d_n:
        # k_pos_emb a column too wide or narrow, or the un-split (whole-TP) weight,
        # still yield a consistent-looking d_v; equal d_n and d_v (every DeepSeek
        # model) is the only reading the tensors fix on their own.
        raise ValueError(f"the tensors read as qk_head_dim={d_n}, v_head_dim={d_v}, which is "
                         "ambiguous (a k_pos_emb of the wrong width or an un-split "
                         "kv_up_weight reads the same way); pass qk_head_dim= and v_head_dim= "
                         "(the MLA config's values)")
    return d_n, d_v


def _check_tensors(query, kv_latent, k_pos_emb, kv_up_weight):
    dtypes = {t.dtype for t in (query, kv_latent, k_pos_emb, kv_up_weight)}
    if len(dtypes) != 1:
        raise ValueError("query, kv_latent, k_pos_emb and kv_up_weight must share one dtype; got "
                         f"{query.dtype}, {kv_latent.dtype}, {k_pos_emb.dtype}, {kv_up_weight.dtype}")
    if not query.dtype.is_floating_point:
        raise ValueError(f"inputs must be floating point, got {query.dtype}")
    if query.dtype not in agreement.DTYPES:
        raise ValueError(f"inputs of dtype {query.dtype} are not supported: the forms run "
                         f"{[str(d) for d in agreement.DTYPES]}; cast query, kv_latent, k_pos_emb "
                         "and kv_up_weight to bfloat16 (float8 recipes keep attention in bf16)")
    devices = {t.device for t in (query, kv_latent, k_pos_emb, kv_up_weight)}
    check_not_meta(devices)
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")


def check_not_meta(devices) -> None:
    """Meta tensors have shapes but no values: nothing can be computed or exchanged on them."""
    if any(torch.device(d).type == "meta" for d in devices):
        raise ValueError(f"inputs on the meta device (got {sorted(map(str, devices))}) have no "
                         "values: materialize the model (to_empty() and initialize, or load its "
                         "checkpoint) and run it on a real device")


def _check_choices(cp_algo, layout, kernel, causal, softmax_scale):
    if cp_algo not in ATTN_CP_ALGOS:
        raise ValueError(f"cp_algo={cp_algo!r} is unknown; use one of {ATTN_CP_ALGOS}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; use one of {LAYOUTS}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is unknown; use one of {KERNELS}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)
            or not _finite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale must be a positive, finite real number (e.g. "
                         f"1/sqrt(qk_head_dim + qk_pos_emb_head_dim)), got {softmax_scale!r}")
    if not SCALE_RANGE[0] <= softmax_scale <= SCALE_RANGE[1]:
        # the fused kernels take the scale in float32: below its range it flushes to zero
        # (torch's CPU flash op then returns NaN where eager math does not)
        raise ValueError(f"softmax_scale must be between {SCALE_RANGE[0]:g} and "
                         f"{SCALE_RANGE[1]:g}, the range every kernel computes alike (MLA's is "
                         f"about 1/sqrt(qk_head_dim + qk_pos_emb_head_dim) times the rope "
                         f"mscale), got {softmax_scale!r}")


# softmax_scale's accepted range: well inside float32's normal range, where every kernel
# (eager math, SDPA, the CPU flash op, the NPU op) gives the same result
SCALE_RANGE = (1e-30, 1e30)


def _finite(x) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond float range (10**400)
        return False


def _check_split(dims: MLADims, local_len: int, cp_size: int, cp_algo: str, layout: str,
                 ulysses_degree: int = 1):
    if cp_size == 1:
        return
    if ulysses_degree > 1:
        _check_hybrid_split(local_len, cp_size, layout, ulysses_degree)
    elif layout == "zigzag" and local_len % 2:
        raise ValueError(
            f"layout='zigzag' needs the sequence divisible by 2*CP={2 * cp_size}: each rank "
            f"holds 2 equal chunks, but this rank holds {local_len} tokens; pad the sequence "
            "to a multiple of 2*CP or use layout='contiguous'")
    if not algo(cp_algo).heads_divide(dims.heads, cp_size, ulysses_degree):
        raise ValueError(
            f"cp_algo='ulysses' splits heads over the CP group: {dims.heads} heads are not "
            f"divisible by CP={cp_size}; use cp_algo='allgather' or a CP size dividing the heads")


def _check_hybrid_split(local_len: int, cp_size: int, layout: str, degree: int):
    multiple = seq_multiple(layout, cp_size, degree)
    if (local_len * cp_size) % multiple:
        raise ValueError(
            f"layout={layout!r} with cp_algo='hybrid' (CP={cp_size}, ulysses_group of {degree}) "
            f"needs the sequence divisible by {multiple} (2R={2 * cp_size // degree} chunks, each "
            f"ring pair cut into {degree} pieces), but it is {local_len * cp_size} tokens "
            f"({local_len} on this rank); pad the sequence to a multiple of {multiple} or use "
            "layout='contiguous'")


def _check_ulysses_group(cp_algo, ulysses_group, cp_group, cp_size: int, heads: int) -> int:
    """Hybrid CP's Ulysses group: U consecutive CP ranks holding this rank -> U (1: not hybrid)."""
    split = algo(cp_algo)
    if not split.takes_ulysses_degree:
        if ulysses_group is not None:
            raise ValueError(f"ulysses_group is given but cp_algo={cp_algo!r}; pass "
                             "cp_algo='hybrid' to split heads inside ulysses_group, or drop "
                             "ulysses_group")
        return 1
    if ulysses_group is None:
        raise ValueError("cp_algo='hybrid' needs ulysses_group=: the process group of the U "
                         "consecutive CP ranks that holds this rank (CP rank c = r*U + u, as "
                         "MindSpeed's hybrid Ulysses group); or use cp_algo='allgather' or "
                         "'ulysses'")
    members, cp_members = _group_ranks(ulysses_group, "ulysses_group"), _cp_ranks(cp_group)
    degree = len(members)
    if not split.degree_divides(cp_size, degree):
        raise ValueError(f"ulysses_group has {degree} ranks, which does not divide CP={cp_size}; "
                         "its size U must divide the CP size (R = CP/U ring ranks)")
    first = comm.group_rank(cp_group) // degree * degree
    expected = cp_members[first:first + degree]
    if members != expected:
        raise ValueError(
            f"ulysses_group must be the {degree} consecutive ranks of cp_group that hold this "
            f"rank (CP ranks {first}..{first + degree - 1}, global ranks {expected}), in CP rank "
            f"order; got global ranks {members}. Build it as MindSpeed's hybrid groups: CP rank "
            "c = r*U + u")
    if not split.heads_divide(heads, cp_size, degree):
        raise ValueError(f"cp_algo='hybrid' splits heads over ulysses_group: {heads} heads (per "
                         f"TP rank) are not divisible by its size U={degree}; use a "
                         "ulysses_group whose size divides the heads")
    return degree


def _group_ranks(group, name: str):
    try:
        return list(torch.distributed.get_process_group_ranks(group))
    except Exception as exc:  # not a process group, or no process group initialized
        raise ValueError(f"{name} must be a torch.distributed process group, got "
                         f"{type(group).__name__} ({exc})") from None


def _cp_ranks(cp_group):
    if cp_group is None:
        return [torch.distributed.get_rank() if torch.distributed.is_initialized() else 0]
    return _group_ranks(cp_group, "cp_group")


def _takes_degree(cp_algo) -> bool:
    """Whether ``cp_algo`` (as passed: maybe not an algorithm) takes a Ulysses group."""
    known = ALGOS.get(cp_algo) if isinstance(cp_algo, str) else None
    return known is not None and known.takes_ulysses_degree


def check_cu_seqlens(cu_seqlens, query, cp_size: int, layout: str, degree: int = 1,
                     cp_group=None):
    """cu_seqlens -> a tuple of global document boundaries (or None), checked (a tensor is
    read once per micro-batch: agreement.memo)."""
    if cu_seqlens is None:
        return resolve_documents(None, 0, layout, cp_size, degree)
    if query.shape[1] != 1:
        raise ValueError(f"cu_seqlens describes one packed sequence, so the micro-batch must be 1 "
                         f"(got {query.shape[1]}); pack the batch into one sequence of documents "
                         "(as --reset-attention-mask does with micro-batch 1) or drop cu_seqlens")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
            raise ValueError("cu_seqlens must be a 1-D integer tensor or a list of ints, got a "
                             f"{cu_seqlens.dtype} tensor of shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.device.type == "meta":
            raise ValueError("cu_seqlens is a meta tensor (it has no values); pass the document "
                             "boundaries as a CPU/device integer tensor or a list of ints")
        cu_seqlens = agreement.memo(cp_group, ("cu_seqlens",) + agreement.tensor_key(cu_seqlens),
                                    cu_seqlens.tolist)
    try:
        return resolve_documents(cu_seqlens, query.shape[0] * cp_size, layout, cp_size, degree)
    except OverflowError:  # int(inf)
        raise ValueError("cu_seqlens must hold finite integer document boundaries (0 ... "
                         f"sequence length), got {list(cu_seqlens)!r}"[:300]) from None


def check_option_values(options: AttnOptions) -> None:
    """The options' values that need no tensors (the flags, LAGA's block options): what an
    adapter can check when it is configured, before the first forward."""
    _check_flags(options)
    if options.form == "laga":
        _check_laga_flags(options)


def _check_laga_flags(options: AttnOptions):
    for name in ("recompute_kv", "trim_causal_prefix"):
        if not isinstance(getattr(options, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(options, name)!r}")
    block = options.kv_block_size
    if block is not None:
        if isinstance(block, bool) or not isinstance(block, int) or not 0 < block < 1 << 63:
            raise ValueError(f"kv_block_size must be a positive int below 2**63 or None, got "
                             f"{block!r}; a block as long as the sequence or longer is one block, "
                             "which None asks for")
        if not options.recompute_kv:
            raise ValueError("kv_block_size needs recompute_kv=True: blockwise rebuild keeps no "
                             "K/V for backward, so it rebuilds them there")
    _check_kv_up_linear(options)


def _check_kv_up_linear(options: AttnOptions):
    """A custom up-projection (an FP8 matmul) replaces F.linear where K/V are rebuilt for
    attention; the blockwise recompute and the empty rows' mean use the weight as a
    matrix, which such a matmul is not."""
    linear = options.kv_up_linear
    if linear is None:
        return
    if not callable(linear):
        raise ValueError(f"kv_up_linear must be a function (latent, weight_rows, first_row) -> "
                         f"K/V or "
                         f"None, got {type(linear).__name__}")
    if options.recompute_kv:
        raise ValueError("kv_up_linear with recompute_kv=True is not supported: the blockwise "
                         "recompute differentiates the up-projection itself as a plain "
                         "matmul; pass recompute_kv=False or no kv_up_linear")
    if options.key_padding_mask is not None and options.empty_rows == "mean":
        raise ValueError("kv_up_linear with key_padding_mask and empty_rows='mean' is not "
                         "supported: the mean of the values is taken as the up-projection of "
                         "the mean latent, which holds for a plain matmul only; pass "
                         "empty_rows='zero' or no kv_up_linear")


def _check_laga_options(options: AttnOptions, kv_latent, k_pos_emb, cp_size: int):
    _check_laga_flags(options)
    gather = options.latent_gather
    if gather is not None:
        from .forms.latent_source import LatentGather
        if not isinstance(gather, LatentGather):
            raise ValueError("latent_gather must come from start_latent_gather(kv_latent, "
                             f"k_pos_emb, cp_group=...), got {type(gather).__name__}")
        if not gather.started_on(kv_latent, k_pos_emb):
            raise ValueError("latent_gather was started on other kv_latent/k_pos_emb tensors than "
                             "the ones passed here; pass the same tensors to both calls")
        if gather.cp_group is not options.cp_group or cp_size == 1:
            raise ValueError("latent_gather was started on another cp_group; pass the same group")
        if gather.lost_grads(kv_latent, k_pos_emb):
            raise ValueError("latent_gather was started under torch.no_grad() (its gather is "
                             "outside autograd), but this call runs in grad mode with kv_latent/"
                             "k_pos_emb needing grads, which would be lost; start the gather in "
                             "grad mode (outside the no_grad block), or call laga_attention "
                             "under no_grad too")


def _check_flags(options: AttnOptions):
    if options.check_ranks is not None and not isinstance(options.check_ranks, bool):
        raise ValueError(f"check_ranks must be True, False or None, got {options.check_ranks!r}")
    if not isinstance(options.pad_v, bool):
        raise ValueError(f"pad_v must be True or False, got {options.pad_v!r}")


def resolve_kernel(kernel: str, device: torch.device, blockwise: bool = False, dtype=None) -> str:
    """The name of the kernel ``kernel`` resolves to ('auto' -> 'npu' on NPU tensors, else
    'sdpa', or 'eager' on the blockwise path where no fused block op exists); ValueError
    when it cannot run these tensors (kernels/registry.py: ``resolve``)."""
    return kernels.resolve(kernel, device, dtype, blockwise).name


def check(query, kv_latent, k_pos_emb, kv_up_weight, options: AttnOptions) -> AttnSetup:
    """Validate one call of a form (its tensors and options) and agree on it across the group.

    ``cp_group`` itself is checked first and alone (no exchange is possible
    over a group that is not one, or without this rank). A call like one that passed
    before (the same options and tensor metadata, :func:`_seen_key`) reuses what that
    call's checks found: only what is new per call is checked again (an overlapped
    gather's handle), and the ranks agree on it as on any call.
    """
    o = options
    cp_size = comm.check_group(o.cp_group)
    tensors = (query, kv_latent, k_pos_emb, kv_up_weight)
    key = _seen_key(o, tensors)
    seen = _seen(o.cp_group).get(key) if key is not None else None
    if seen is not None:
        failure = None
        try:
            if o.latent_gather is not None:
                _check_laga_options(o, kv_latent, k_pos_emb, cp_size)
        except Exception as exc:  # noqa: BLE001 -- whatever failed, the peers must hear of it
            if cp_size == 1:
                raise
            failure = exc
        agree_on_call(o, tensors, seen[0], seen[1], failure, seen[4])
        return _setup(o, query, cp_size, *seen[:4])
    failure: Optional[BaseException] = None
    dims = documents = None
    degree, kernel = 1, None
    try:
        _check_flags(o)
        _check_choices(o.cp_algo, o.layout, o.kernel, o.causal, o.softmax_scale)
        dims = _dims(query, kv_latent, k_pos_emb, kv_up_weight, o.qk_head_dim, o.v_head_dim)
        _check_tensors(query, kv_latent, k_pos_emb, kv_up_weight)
        degree = _check_ulysses_group(o.cp_algo, o.ulysses_group, o.cp_group, cp_size, dims.heads)
        _check_split(dims, query.shape[0], cp_size, o.cp_algo, o.layout, degree)
        documents = check_cu_seqlens(o.cu_seqlens, query, cp_size, o.layout, degree,
                                     o.cp_group)
        kernel = kernels.resolve(o.kernel, query.device, query.dtype, o.blockwise, o.pad_v)
        check_empty_rows(o.empty_rows)
        check_key_padding(o.key_padding_mask, query, cp_size, documents)
        if o.form == "laga":
            _check_laga_options(o, kv_latent, k_pos_emb, cp_size)
    except Exception as exc:  # noqa: BLE001 -- whatever failed, the peers must hear of it
        if cp_size == 1:
            raise
        failure = exc
    agree_on_call(o, tensors, dims, documents, failure)
    if key is not None and failure is None:
        found = _seen(o.cp_group)
        if len(found) >= SEEN_KEPT:
            found.clear()
        found[key] = (dims, documents, kernel, degree, {})  # {}: the row's fixed part
    return _setup(o, query, cp_size, dims, documents, kernel, degree)


def _setup(o: AttnOptions, query, cp_size: int, dims, documents, kernel, degree) -> AttnSetup:
    return AttnSetup(dims=dims, local_len=query.shape[0], batch=query.shape[1],
                     cp_group=o.cp_group, cp_size=cp_size, cp_rank=comm.group_rank(o.cp_group),
                     cp_algo=o.cp_algo, layout=o.layout, causal=o.causal, kernel=kernel,
                     softmax_scale=float(o.softmax_scale), documents=documents,
                     ulysses_group=o.ulysses_group if _takes_degree(o.cp_algo) else None,
                     ulysses_degree=degree, key_padding=o.key_padding_mask,
                     empty_rows=o.empty_rows)


# What the checks of the calls that passed found, per CP group (weak keys: it dies with its
# group) and :func:`_seen_key`: a few per model, one per shape and options; cleared when full.
_SEEN: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
_SEEN_WITHOUT_CP: dict = {}
SEEN_KEPT = 64
# What a passed call's checks read besides the tensors' metadata and the CP group: every
# option but the per-call ones (the key padding mask, read by value; the overlapped
# gather's handle, checked per call) and the Ulysses group (held weakly in the key).
_SEEN_FIELDS = tuple(f for f in AttnOptions.__dataclass_fields__
                     if f not in ("cp_group", "ulysses_group", "key_padding_mask", "latent_gather"))
_SEEN_VALUES = operator.attrgetter(*_SEEN_FIELDS)  # one C call for them all


def _seen(cp_group) -> dict:
    if cp_group is None:
        return _SEEN_WITHOUT_CP
    found = _SEEN.get(cp_group)
    if found is None:
        found = _SEEN[cp_group] = {}
    return found


def _seen_key(o: AttnOptions, tensors) -> Optional[tuple]:
    """What the checks of a call read, hashable (each value with its type: ``True`` and
    ``1`` are not one option), or None: the call is checked in full (a key padding mask,
    documents as a tensor or list, an unhashable option, an input that is no tensor)."""
    if o.key_padding_mask is not None or not isinstance(o.cu_seqlens, (tuple, type(None))):
        return None
    q, kv, pe, w = tensors
    if not (isinstance(q, torch.Tensor) and isinstance(kv, torch.Tensor)
            and isinstance(pe, torch.Tensor) and isinstance(w, torch.Tensor)):
        return None
    documents = None if o.cu_seqlens is None else tuple((type(v), v) for v in o.cu_seqlens)
    ulysses = None if o.ulysses_group is None else _weak(o.ulysses_group)
    values = _SEEN_VALUES(o)
    # spelled out, not a generator: this runs on every call
    key = (values, tuple(map(type, values)), documents, ulysses, o.latent_gather is None,
           type(q), q.shape, q.dtype, q.device, type(kv), kv.shape, kv.dtype, kv.device,
           type(pe), pe.shape, pe.dtype, pe.device, type(w), w.shape, w.dtype, w.device)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _weak(group):
    try:
        return weakref.ref(group)
    except TypeError:
        return (type(group), group)  # not a process group: its own checks reject it

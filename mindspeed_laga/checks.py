"""Argument checks shared by the three forms.

Every check runs before any data collective. With CP > 1 the ranks then
exchange their verdict and every value that must agree (handshake.py): if
any rank rejected its arguments, or the ranks disagree, *every* rank raises
the ``ValueError`` instead of some ranks waiting forever in a collective or
returning wrong numbers.
"""
from __future__ import annotations

import hashlib
import math
import numbers
import struct
from typing import Dict, Optional

import torch

from . import comm, handshake
from .vocab.names import ATTN_CP_ALGOS, FORMS, HYBRID, KERNELS, LAYOUTS
from .vocab.attn_setup import AttnSetup, heads_split
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
    devices = {t.device for t in (query, kv_latent, k_pos_emb, kv_up_weight)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")


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
            or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale must be a positive, finite real number (e.g. "
                         f"1/sqrt(qk_head_dim + qk_pos_emb_head_dim)), got {softmax_scale!r}")


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
    if heads_split(cp_algo, cp_size) and dims.heads % cp_size:
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
    if cp_algo != HYBRID:
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
    if cp_size % degree:
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
    if heads % degree:
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


def _ulysses_degree_value(cp_algo, ulysses_group) -> int:
    """U for the handshake (-1 when unknown), so ranks that differ on it raise alike."""
    if cp_algo != HYBRID and ulysses_group is None:
        return 1
    try:
        return comm.group_size(ulysses_group)
    except Exception:
        return handshake.UNKNOWN


def _documents(cu_seqlens, query, cp_size: int, layout: str, degree: int = 1):
    """cu_seqlens -> a tuple of global document boundaries (or None), checked."""
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
        cu_seqlens = cu_seqlens.tolist()
    return resolve_documents(cu_seqlens, query.shape[0] * cp_size, layout, cp_size, degree)


def documents_code(documents) -> int:
    """The document boundaries as one int64 for the handshake (0: no documents)."""
    if documents is None:
        return 0
    digest = hashlib.blake2b(repr(documents).encode(), digest_size=8).digest()
    return struct.unpack("<q", digest)[0] or 1


def _fused_block_ops(device: torch.device, dtype) -> bool:
    """Whether kernels/block.py has fused ops for these tensors (CUDA's memory-
    efficient kernel has no float64)."""
    return device.type == "cpu" or (device.type == "cuda" and dtype != torch.float64)


def resolve_kernel(kernel: str, device: torch.device, blockwise: bool = False, dtype=None) -> str:
    """'auto' -> 'npu' on NPU tensors, else 'sdpa'; 'npu' needs torch_npu.

    For the blockwise recompute path 'sdpa' is the fused block kernel
    (kernels/block.py: CPU flash or CUDA memory-efficient attention) and
    'eager' the reference math; 'auto' picks 'eager' where no fused block op
    exists for the device and dtype."""
    if kernel == "auto":
        fused = not blockwise or _fused_block_ops(device, dtype)
        kernel = "npu" if device.type == "npu" else ("sdpa" if fused else "eager")
    if blockwise and kernel == "sdpa" and not _fused_block_ops(device, dtype):
        raise ValueError(
            f"recompute_kv=True with kernel='sdpa' runs fused block ops for CPU tensors and "
            f"CUDA tensors other than float64, not {device.type} {dtype}; use kernel='eager' "
            "(or 'auto', which picks it)")
    if kernel == "npu":
        from .kernels import npu
        npu.require_torch_npu()
    return kernel


def check(query, kv_latent, k_pos_emb, kv_up_weight, *, softmax_scale, cp_group, cp_algo,
          layout, causal, kernel, form: str, check_ranks: bool = True, blockwise: bool = False,
          qk_head_dim: Optional[int] = None, v_head_dim: Optional[int] = None,
          options: Optional[Dict[str, int]] = None, cu_seqlens=None, pad_v: bool = False,
          extra_check=None, ulysses_group=None) -> AttnSetup:
    """Validate the arguments of a form and agree on them across the CP group.

    ``options``: the form's options as integers (field names of
    handshake.FIELDS); ``extra_check(cp_size)`` runs with the local checks;
    ``ulysses_group``: hybrid CP's Ulysses group (cp_algo='hybrid' only).
    """
    cp_size = comm.group_size(cp_group)
    error: Optional[str] = None
    dims = documents = None
    degree = 1
    try:
        if not isinstance(check_ranks, bool):
            raise ValueError(f"check_ranks must be True or False, got {check_ranks!r}")
        _check_choices(cp_algo, layout, kernel, causal, softmax_scale)
        if not isinstance(pad_v, bool):
            raise ValueError(f"pad_v must be True or False, got {pad_v!r}")
        dims = _dims(query, kv_latent, k_pos_emb, kv_up_weight, qk_head_dim, v_head_dim)
        _check_tensors(query, kv_latent, k_pos_emb, kv_up_weight)
        degree = _check_ulysses_group(cp_algo, ulysses_group, cp_group, cp_size, dims.heads)
        _check_split(dims, query.shape[0], cp_size, cp_algo, layout, degree)
        documents = _documents(cu_seqlens, query, cp_size, layout, degree)
        kernel = resolve_kernel(kernel, query.device, blockwise, query.dtype)
        if extra_check is not None:
            extra_check(cp_size)
    except ValueError as exc:
        if cp_size == 1:
            raise
        error = str(exc)
    if handshake.skips(cp_group):  # every rank agreed to skip: build no row on the hot path
        if error is not None:
            raise ValueError(error)
    else:
        values = _agreed_values(form, cp_algo, layout, causal, softmax_scale, check_ranks, query,
                                (query, kv_latent, k_pos_emb, kv_up_weight), dims, options)
        values["ulysses_degree"] = _ulysses_degree_value(cp_algo, ulysses_group)
        if error is None:
            values["documents"] = documents_code(documents)
        device = query.device if isinstance(query, torch.Tensor) else "cpu"
        handshake.agree(values, error, cp_group, device, names=_NAMES)
    return AttnSetup(dims=dims, local_len=query.shape[0], batch=query.shape[1],
                     cp_group=cp_group, cp_size=cp_size, cp_rank=comm.group_rank(cp_group),
                     cp_algo=cp_algo, layout=layout, causal=causal, kernel=kernel,
                     softmax_scale=float(softmax_scale), documents=documents, pad_v=pad_v,
                     ulysses_group=ulysses_group if cp_algo == HYBRID else None,
                     ulysses_degree=degree)


_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_NAMES = {"form": FORMS, "cp_algo": ATTN_CP_ALGOS, "layout": LAYOUTS, "stage": handshake.STAGES,
          "dtype": tuple(str(d) for d in _DTYPES)}


def _code(choices, value) -> int:
    return choices.index(value) if value in choices else handshake.UNKNOWN


def _agreed_values(form, cp_algo, layout, causal, softmax_scale, check_ranks, query, tensors,
                   dims: Optional[MLADims], options) -> Dict[str, int]:
    """What every rank must agree on, as integers (unknown values stay out)."""
    values = {"stage": 0, "check_ranks": int(bool(check_ranks)), "form": _code(FORMS, form),
              "cp_algo": _code(ATTN_CP_ALGOS, cp_algo), "layout": _code(LAYOUTS, layout)}
    if isinstance(causal, bool):
        values["causal"] = int(causal)
    if isinstance(softmax_scale, numbers.Real) and not isinstance(softmax_scale, bool):
        values["softmax_scale"] = handshake.float_bits(softmax_scale)
    if dims is not None:
        values.update(local_len=query.shape[0], micro_batch=query.shape[1], heads=dims.heads,
                      qk_head_dim=dims.qk_head_dim, rope_dim=dims.rope_dim,
                      v_head_dim=dims.v_head_dim, kv_lora_rank=dims.kv_lora_rank,
                      dtype=_code(_DTYPES, query.dtype),
                      requires_grad=int(torch.is_grad_enabled()
                                        and any(t.requires_grad for t in tensors)))
    values.update(options or {})
    return values

"""Argument checks shared by the three forms.

Every check runs before any data collective. With CP > 1 the ranks then
exchange a few integers (their verdict and their shapes): if any rank rejected
its arguments, or the ranks disagree on shapes, *every* rank raises the
``ValueError`` instead of some ranks waiting forever in a collective.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from . import comm, layout as layouts

CP_ALGOS = ("allgather", "ulysses")
KERNELS = ("auto", "eager", "sdpa", "npu")


@dataclass(frozen=True)
class MLADims:
    """MLA sizes inferred from the tensors (DeepSeek-V3: 128, 128, 64, 128, 512)."""

    heads: int          # n: heads on this TP rank
    qk_head_dim: int    # d_n
    rope_dim: int       # d_r (qk_pos_emb_head_dim)
    v_head_dim: int     # d_v
    kv_lora_rank: int   # d_c


@dataclass(frozen=True)
class AttnSetup:
    """Everything a form needs besides the tensors."""

    dims: MLADims
    local_len: int
    batch: int
    cp_group: object
    cp_size: int
    cp_rank: int
    cp_algo: str
    layout: str
    causal: bool
    kernel: str
    softmax_scale: float


def _dims(query, kv_latent, k_pos_emb, kv_up_weight) -> MLADims:
    for name, t, nd in (("query", query, 4), ("kv_latent", kv_latent, 3),
                        ("k_pos_emb", k_pos_emb, 3), ("kv_up_weight", kv_up_weight, 2)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != nd:
            raise ValueError(f"{name} must have {nd} dims, got shape {tuple(t.shape)}; "
                             "see the laga_attention docstring for the [s, b, ...] layouts")
    s, b, n, q_dim = query.shape
    d_r = k_pos_emb.shape[-1]
    d_c = kv_latent.shape[-1]
    if kv_latent.shape[:2] != (s, b) or k_pos_emb.shape[:2] != (s, b):
        raise ValueError(
            f"query, kv_latent and k_pos_emb must share [s, b]; got {tuple(query.shape[:2])}, "
            f"{tuple(kv_latent.shape[:2])}, {tuple(k_pos_emb.shape[:2])}")
    d_n = q_dim - d_r
    if d_n <= 0:
        raise ValueError(f"query's last dim ({q_dim}) must be qk_head_dim + qk_pos_emb_head_dim "
                         f"with qk_pos_emb_head_dim = k_pos_emb.shape[-1] = {d_r}")
    rows, cols = kv_up_weight.shape
    if cols != d_c:
        raise ValueError(f"kv_up_weight must be [n*(qk_head_dim+v_head_dim), kv_lora_rank={d_c}] "
                         f"(Megatron's linear_kv_up_proj.weight); got {tuple(kv_up_weight.shape)}")
    if rows % n or rows // n <= d_n:
        raise ValueError(f"kv_up_weight has {rows} rows; it must be n*(qk_head_dim+v_head_dim) "
                         f"with n={n} heads and qk_head_dim={d_n}")
    return MLADims(n, d_n, d_r, rows // n - d_n, d_c)


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
    if cp_algo not in CP_ALGOS:
        raise ValueError(f"cp_algo={cp_algo!r} is unknown; use one of {CP_ALGOS}")
    if layout not in layouts.LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; use one of {layouts.LAYOUTS}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is unknown; use one of {KERNELS}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if not isinstance(softmax_scale, (int, float)) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive number, got {softmax_scale!r}")


def _check_split(dims: MLADims, local_len: int, cp_size: int, cp_algo: str, layout: str):
    if cp_size == 1:
        return
    if layout == "zigzag" and local_len % 2:
        raise ValueError(
            f"layout='zigzag' needs the sequence divisible by 2*CP={2 * cp_size}: each rank "
            f"holds 2 equal chunks, but this rank holds {local_len} tokens; pad the sequence "
            "to a multiple of 2*CP or use layout='contiguous'")
    if cp_algo == "ulysses" and dims.heads % cp_size:
        raise ValueError(
            f"cp_algo='ulysses' splits heads over the CP group: {dims.heads} heads are not "
            f"divisible by CP={cp_size}; use cp_algo='allgather' or a CP size dividing the heads")


def _fused_block_ops(device: torch.device, dtype) -> bool:
    """Whether forms/fused_block.py has fused ops for these tensors (CUDA's memory-
    efficient kernel has no float64)."""
    return device.type == "cpu" or (device.type == "cuda" and dtype != torch.float64)


def resolve_kernel(kernel: str, device: torch.device, blockwise: bool = False, dtype=None) -> str:
    """'auto' -> 'npu' on NPU tensors, else 'sdpa'; 'npu' needs torch_npu.

    For the blockwise recompute path 'sdpa' is the fused block kernel
    (forms/fused_block.py: CPU flash or CUDA memory-efficient attention) and
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
          layout, causal, kernel, check_ranks: bool = True, blockwise: bool = False,
          extra_check=None) -> AttnSetup:
    """Validate the arguments of a form and agree on them across the CP group.

    ``extra_check(cp_size)`` runs with the other local checks (form options).
    """
    cp_size = comm.group_size(cp_group)
    error: Optional[str] = None
    dims = None
    try:
        _check_choices(cp_algo, layout, kernel, causal, softmax_scale)
        dims = _dims(query, kv_latent, k_pos_emb, kv_up_weight)
        _check_tensors(query, kv_latent, k_pos_emb, kv_up_weight)
        _check_split(dims, query.shape[0], cp_size, cp_algo, layout)
        kernel = resolve_kernel(kernel, query.device, blockwise, query.dtype)
        if extra_check is not None:
            extra_check(cp_size)
    except ValueError as exc:
        if cp_size == 1 or not check_ranks:
            raise
        error = str(exc)
    if cp_size > 1 and check_ranks:
        _agree(error, query, dims, cp_group)
    return AttnSetup(dims=dims, local_len=query.shape[0], batch=query.shape[1],
                     cp_group=cp_group, cp_size=cp_size, cp_rank=comm.group_rank(cp_group),
                     cp_algo=cp_algo, layout=layout, causal=causal, kernel=kernel,
                     softmax_scale=float(softmax_scale))


def _agree(error: Optional[str], query, dims: Optional[MLADims], cp_group):
    """Exchange verdicts and shapes; raise the same way on every rank."""
    shape: List[int] = [-1] * 7
    if dims is not None:
        shape = [query.shape[0], query.shape[1], dims.heads, dims.qk_head_dim, dims.rope_dim,
                 dims.v_head_dim, dims.kv_lora_rank]
    table = comm.handshake([0 if error is None else 1] + shape, cp_group, query.device)
    if error is not None:
        raise ValueError(error)
    bad = [r for r, row in enumerate(table) if row[0]]
    if bad:
        raise ValueError(f"CP rank(s) {bad} rejected their arguments (see the error there); "
                         "no collective was issued")
    names = ("local sequence length", "micro-batch", "heads", "qk_head_dim",
             "qk_pos_emb_head_dim", "v_head_dim", "kv_lora_rank")
    for i, name in enumerate(names, start=1):
        values = [row[i] for row in table]
        if len(set(values)) != 1:
            raise ValueError(f"CP ranks disagree on the {name}: {values} (by rank); every rank "
                             "of cp_group must pass the same shapes")

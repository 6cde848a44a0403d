"""``doctor``'s on-device exactness checks: every form x kernel x LAGA option on this
process's device, forward and every grad, against a float64 CPU reference.

Two shapes: small DeepSeek-shaped dims (DeepSeek-V3's head dims / 8) and the
exact head dims the NPU kernel must accept (q/k 192, v 128 per head; 576/512
in the absorbed form). Without CP (one device): the multi-rank paths are the
CP check's job. Packed documents go through ``cu_seqlens``; on NPU both V
layouts (``pad_v``) run. The blockwise kernel's log-sum-exp merge is checked
directly as well: several key blocks against one block of every key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import equivalence as eq
from ...api import FORMS
from ...kernels import KERNEL_TYPES
from ..cases import DTYPES, INPUTS, MLAShape, full_inputs
from .verify import TOLERANCE as VERIFY_TOLERANCE

# Worst |got - ref| / max|ref| over the output and every grad. The reference runs in
# float64 on the same dtype-rounded inputs, so only the kernel's own rounding counts:
# float32: 1e-5 is ~100 ulps (2^-24) of accumulated rounding over reductions of at most
#   576 terms (the absorbed head dim) and a softmax: tight enough to catch a wrong
#   mask or a dropped block (errors of order 1), loose enough for any fp32 kernel.
# bfloat16: 8 * 2^-9 = 4 x bf16's unit roundoff 2^-8 (2 ulps at 1): outputs and grads
#   are rounded to bf16 at least once (grads of the rebuild twice), accumulating in fp32.
# The same figures as ``mindspeed-laga verify`` and the equivalence tests.
TOLERANCE = dict(VERIFY_TOLERANCE)
SEED = 2024

SHAPES = {
    # DeepSeek-V3's 128/64/128/512 divided by 8, 4 heads: every path, in milliseconds on CPU.
    "small": MLAShape(seq_len=32, batch=1, heads=4, qk_head_dim=16, rope_dim=8, v_head_dim=16,
                      kv_lora_rank=64),
    # DeepSeek-V3's head dims: q/k 128+64 = 192, v 128; absorbed q/k 512+64 = 576, v 512.
    "deepseek_dims": MLAShape(seq_len=16, batch=1, heads=2, qk_head_dim=128, rope_dim=64,
                              v_head_dim=128, kv_lora_rank=512),
}


def laga_options(seq_len: int) -> List[dict]:
    block = seq_len // 2  # two key blocks: the online softmax merges across them
    return [{}, {"trim_causal_prefix": True}, {"recompute_kv": True},
            {"recompute_kv": True, "kv_block_size": block},
            {"recompute_kv": True, "kv_block_size": block, "trim_causal_prefix": True}]


def documents_for(seq_len: int) -> Tuple[int, ...]:
    """Three ragged documents: one short, boundaries off any block or chunk edge."""
    return (0, 5, seq_len * 5 // 8, seq_len)


@dataclass(frozen=True)
class Check:
    """One on-device run (``kind`` "reference") or one merge check (``kind`` "lse_merge")."""

    form: str
    kernel: str
    dtype: str
    shape: str
    options: Tuple[tuple, ...] = ()
    documents: Optional[Tuple[int, ...]] = None
    pad_v: bool = False
    kind: str = "reference"

    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        parts = [self.form, self.kernel, self.dtype, self.shape] + ([opts] if opts else [])
        if self.documents:
            parts.append("docs=" + "/".join(map(str, self.documents)))
        if KERNEL_TYPES[self.kernel].pads_v:
            parts.append("padded V" if self.pad_v else "unpadded V")
        return ("lse merge: " if self.kind == "lse_merge" else "") + " ".join(parts)


def plan(kernels, dtypes, npu_documents: bool) -> List[Check]:
    """Every check to run for these kernels and dtypes."""
    checks = []
    for shape_name, shape in SHAPES.items():
        S = shape.seq_len
        for kernel in kernels:
            for dtype in dtypes:
                pads = (False, True) if KERNEL_TYPES[kernel].pads_v else (False,)
                for pad_v in pads:
                    base = dict(kernel=kernel, dtype=dtype, shape=shape_name, pad_v=pad_v)
                    opts_list = laga_options(S) if not pad_v else laga_options(S)[::3]
                    checks += [Check(form=f, **base) for f in ("explicit", "absorbed")]
                    checks += [Check(form="laga", options=tuple(o.items()), **base) for o in opts_list]
                    if not KERNEL_TYPES[kernel].documents_need_build or npu_documents:
                        docs = documents_for(S)
                        checks += [Check(form=f, documents=docs, **base) for f in ("explicit", "absorbed")]
                        checks += [Check(form="laga", options=tuple(o.items()), documents=docs, **base)
                                   for o in (laga_options(S)[0], laga_options(S)[-1])]
                    four_blocks = (("recompute_kv", True), ("kv_block_size", S // 4))
                    checks.append(Check(form="laga", kind="lse_merge", options=four_blocks, **base))
    return checks


def run_all(checks: List[Check], device: torch.device,
            progress: Optional[Callable[[str], None]] = None) -> List[dict]:
    refs: Dict[tuple, dict] = {}
    rows = []
    for check in checks:
        rows.append(run_check(check, device, refs))
        if progress:
            progress(rows[-1])
    return rows


def run_check(check: Check, device: torch.device, refs: Optional[dict] = None) -> dict:
    """One check's row: errors per tensor, worst error, tolerance, pass/fail.

    A check that raises fails with the error (a path that cannot run is a
    finding), except where the package rejects the kernel on this device by
    design, or torch_npu raises NotImplementedError: then "n/a" with the reason."""
    row = {"label": check.label(), "kind": check.kind, "form": check.form, "kernel": check.kernel,
           "dtype": check.dtype, "shape": check.shape, "options": dict(check.options),
           "documents": list(check.documents) if check.documents else None,
           "pad_v": check.pad_v if KERNEL_TYPES[check.kernel].pads_v else None,
           "tolerance": TOLERANCE[check.dtype]}
    unsupported = _not_a_path(check, device)
    if unsupported:
        return dict(row, status="n/a", error=unsupported, passed=True, max_rel_err=None)
    try:
        if check.kind == "lse_merge":
            several = _run(check, device)
            one = _run(check, device, options={"recompute_kv": True, "kv_block_size": None})
            errors = eq.relative_errors(several, one)
        else:
            key = (check.shape, check.dtype, check.documents)
            ref = (refs or {}).get(key) or reference(check)
            if refs is not None:
                refs[key] = ref
            errors = eq.relative_errors(_run(check, device), ref)
    except NotImplementedError as exc:
        return dict(row, status="n/a", error=_first_line(exc), passed=True, max_rel_err=None)
    except Exception as exc:  # noqa: BLE001 - reported in the row and fails the doctor
        return dict(row, status="error", error=f"{type(exc).__name__}: {_first_line(exc)}",
                    passed=False, max_rel_err=None)
    worst = max(errors.values())
    passed = worst <= TOLERANCE[check.dtype]  # NaN fails
    return dict(row, errors=errors, max_rel_err=worst, passed=passed,
                status="pass" if passed else "FAIL")


def _not_a_path(check: Check, device: torch.device) -> Optional[str]:
    """Why the package rejects this kernel here by design (it raises ValueError saying
    so), e.g. ``recompute_kv`` with kernel "sdpa" where no fused block op exists."""
    from ... import checks
    blockwise = dict(check.options).get("recompute_kv", False)
    try:
        checks.resolve_kernel(check.kernel, device, blockwise=blockwise, dtype=DTYPES[check.dtype])
    except ValueError as exc:
        return f"not a path on {device.type}: {_first_line(exc)}"
    return None


def _run(check: Check, device: torch.device, options: Optional[dict] = None) -> dict:
    """Forward + backward of the check's form on ``device``; output and grads as float64 CPU."""
    shape = SHAPES[check.shape]
    dtype = DTYPES[check.dtype]
    full = full_inputs(shape, SEED)
    leaves = {k: full[k].to(device, dtype).requires_grad_() for k in INPUTS}
    kwargs = dict(check.options) if options is None else {k: v for k, v in options.items() if v is not None}
    out = FORMS[check.form](*(leaves[k] for k in INPUTS), softmax_scale=shape.softmax_scale,
                            cp_group=None, causal=True, kernel=check.kernel,
                            qk_head_dim=shape.qk_head_dim, v_head_dim=shape.v_head_dim,
                            cu_seqlens=list(check.documents) if check.documents else None,
                            pad_v=check.pad_v, **kwargs)
    out.backward(full["grad_out"].to(device, dtype))
    return {"out": out.detach().double().cpu(),
            "grads": {k: v.grad.detach().double().cpu() for k, v in leaves.items()}}


def reference(check: Check) -> dict:
    """Float64 CPU output and grads from the same dtype-rounded inputs: the equivalence
    reference, or with documents the definition with a document mask."""
    shape = SHAPES[check.shape]
    if not check.documents:
        return eq.reference(eq.Case(dtype=check.dtype, shape=shape, seed=SEED))
    return document_reference(shape, check.dtype, check.documents)


def document_reference(shape: MLAShape, dtype: str, bounds) -> dict:
    """Causal softmax attention over the full sequence where a query sees only keys of
    its own document (ids from the boundaries; no segments, windows or pieces)."""
    full = full_inputs(shape, SEED)
    x = {k: full[k].to(DTYPES[dtype]).double().requires_grad_() for k in INPUTS}
    S, b, n = shape.seq_len, shape.batch, shape.heads
    d_n, d_v = shape.qk_head_dim, shape.v_head_dim
    w = x["kv_up_weight"].view(n, d_n + d_v, -1)
    k_nope = torch.einsum("sbc,ndc->sbnd", x["kv_latent"], w[:, :d_n])
    value = torch.einsum("sbc,nvc->sbnv", x["kv_latent"], w[:, d_n:])
    key = torch.cat([k_nope, x["k_pos_emb"][:, :, None].expand(S, b, n, shape.rope_dim)], dim=-1)
    doc = torch.zeros(S, dtype=torch.long)
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        doc[lo:hi] = i
    pos = torch.arange(S)
    keep = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    scores = torch.einsum("qbnd,kbnd->bnqk", x["query"], key) * shape.softmax_scale
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    out = torch.einsum("bnqk,kbnv->qbnv", probs, value).reshape(S, b, n * d_v)
    out.backward(full["grad_out"].to(DTYPES[dtype]).double())
    return {"out": out.detach(), "grads": {k: v.grad for k, v in x.items()}}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = ["Check", "SHAPES", "TOLERANCE", "plan", "run_all", "run_check", "reference",
           "document_reference"]

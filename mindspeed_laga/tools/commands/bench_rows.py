"""``bench``'s rows: each run's measurements on every rank beside the cost model's
figures, its error against the float64 reference, and the ratios against explicit."""
from __future__ import annotations

from typing import Dict, List

from .. import costmodel as cm
from .output import MiB, ratio as _ratio
from .timing import timing_conclusive


def make_rows(runs, models, per_rank: List[List[dict]], ulysses_degree: int = 1) -> List[dict]:
    """One JSON row per run: measured (rank 0, worst error/time over ranks) and modelled."""
    from .. import equivalence as eq
    rows = []
    refs: Dict[tuple, dict] = {}
    for i, (case, model) in enumerate(zip(runs, models)):
        ranks = [r[i] for r in per_rank]
        key = (case.shape, case.dtype, case.seed, case.causal, case.cu_seqlens)
        if key not in refs:
            refs[key] = eq.reference(case) if case.cu_seqlens is None else document_reference(case)
        err = max(eq.relative_errors(eq.assemble(ranks, case), refs[key]).values())
        r0 = ranks[0]
        fwd = _comm(r0, "forward", "payload")
        bwd = _comm(r0, "backward", "payload")
        wire = _comm(r0, "forward", "wire") + _comm(r0, "backward", "wire")
        peak = [r["peak_bytes"] for r in ranks if r["peak_bytes"] is not None]
        unmeasured = [r.get("peak_reason") for r in ranks if r["peak_bytes"] is None]
        rows.append({
            "seq_len": case.shape.seq_len, "cp_algo": case.cp_algo, "layout": case.layout,
            "documents": len(case.cu_seqlens) - 1 if case.cu_seqlens else 1,
            "cu_seqlens": list(case.cu_seqlens) if case.cu_seqlens else None,
            "variant": case.spec.name, "form": case.form, "kernel": case.kernel,
            "model_kernel": model.kernel, "options": dict(case.options),
            "comm_forward_bytes": fwd, "comm_backward_bytes": bwd, "comm_wire_bytes": wire,
            "comm_design_bytes": sum(r0["design_bytes"].values()),
            "model_comm_forward_bytes": model.comm_bytes("forward"),
            "model_comm_backward_bytes": model.comm_bytes("backward"),
            "model_comm_wire_bytes": model.comm_bytes(None, "wire"),
            "saved_bytes": r0["saved_bytes"], "saved_kib": r0["saved_bytes"] / 1024,
            "saved_bytes_by_rank": [r["saved_bytes"] for r in ranks],
            "model_saved_bytes": model.saved_bytes, "model_saved_kib": model.saved_bytes / 1024,
            "model_saved_terms": [t.__dict__ for t in model.saved],
            "saved_measured_over_model": _ratio(r0["saved_bytes"], model.saved_bytes),
            "peak_bytes": max(peak) if peak else None,
            "peak_mib": f"{max(peak) / MiB:.2f}" if peak else "n/a",
            "peak_reason": None if peak else (unmeasured[0] if unmeasured else None),
            "model_peak_bytes": model.peak_bytes, "model_peak_mib": model.peak_bytes / MiB,
            "model_peak_terms": [t.__dict__ for t in model.peak],
            "peak_measured_over_model": _ratio(max(peak), model.peak_bytes) if peak else None,
            "model_attention_flops": model.flops["attention_fwd"] + model.flops["attention_bwd"],
            "model_attention_gflop": (model.flops["attention_fwd"] + model.flops["attention_bwd"]) / 1e9,
            "model_attention_visible_fwd_flops": model.flops["attention_visible_fwd"],
            "ms": 1e3 * max(r["seconds"] for r in ranks),
            **_time_spread(ranks),
            "comm_seconds": r0.get("comm_seconds"),
            "max_rel_err": err,
        })
        if ulysses_degree > 1:
            rows[-1].update({"ulysses_degree": ulysses_degree,
                             "comm_wire_by_group": r0["wire_by_group"],
                             "model_comm_wire_by_group": cm.comm_by_group(model)})
    _add_relative(rows)
    return rows


def _time_spread(ranks: List[dict]) -> dict:
    """The fastest and slowest timed run, each run timed by its slowest rank."""
    runs = [max(per_rank) for per_rank in zip(*(r.get("seconds_runs") or [r["seconds"]] for r in ranks))]
    return {"ms_min": 1e3 * min(runs), "ms_max": 1e3 * max(runs), "timed_runs": len(runs)}


def _comm(result, direction, measure) -> int:
    return sum(v[measure] for k, v in result["comm"].get(direction, {}).items() if k != "handshake")


def _group(r: dict) -> tuple:
    return r["seq_len"], r["cp_algo"], r["documents"]


def document_reference(case) -> dict:
    """Float64 single-device output and grads with packed documents: every document is
    an independent sequence, so the reference runs each alone and concatenates (the
    kv_up_weight grads add up)."""
    import torch
    from ..cases import DTYPES, INPUTS, full_inputs
    from ...reference import mla_attention_reference
    full = full_inputs(case.shape, case.seed)
    dtype = DTYPES[case.dtype]
    inputs = {k: full[k].to(dtype).double().requires_grad_() for k in INPUTS}
    grad_out = full["grad_out"].to(dtype).double()
    outs = []
    for a, b in zip(case.cu_seqlens[:-1], case.cu_seqlens[1:]):
        outs.append(mla_attention_reference(*(inputs[k][a:b] for k in INPUTS[:3]), inputs["kv_up_weight"],
                                            softmax_scale=case.shape.softmax_scale, causal=case.causal))
    out = torch.cat(outs)
    out.backward(grad_out)
    return {"out": out.detach(), "grads": {k: v.grad for k, v in inputs.items()}}


def _add_relative(rows: List[dict]) -> None:
    """Ratios against explicit at the same (seq_len, cp_algo); the overlap share."""
    groups: Dict[tuple, Dict[str, dict]] = {}
    for r in rows:
        groups.setdefault(_group(r), {})[r["variant"]] = r
    for group in groups.values():
        ex = group["explicit"]
        for r in group.values():
            total = r["comm_forward_bytes"] + r["comm_backward_bytes"]
            r["comm_explicit_over_form"] = _ratio(ex["comm_forward_bytes"] + ex["comm_backward_bytes"], total)
            r["saved_form_over_explicit"] = _ratio(r["saved_bytes"], ex["saved_bytes"])
        base, ov = group.get("laga+qproj"), group.get("laga+overlap")
        if base and ov:
            ov["overlap_speedup"] = base["ms"] / ov["ms"]
            ov["overlap_conclusive"] = timing_conclusive(base, ov)
            blocked = [(x.get("comm_seconds") or {}).get("latent") for x in (base, ov)]
            if None not in blocked and blocked[0] > 0:
                ov["latent_blocked_ms"] = {"without_overlap": 1e3 * blocked[0], "with_overlap": 1e3 * blocked[1]}
                ov["latent_comm_hidden_share"] = 1 - blocked[1] / blocked[0]

"""Measure one attention variant on one CP rank: bytes, saved activations, FLOPs, time.

Used by ``mindspeed-laga bench`` and the cost-model tests.

- Saved activations: every tensor autograd packs for backward inside the
  attention call (``torch.autograd.graph.saved_tensors_hooks``), counted by
  *storage*, once each (a saved view keeps its whole storage alive, so the
  storage's size is what memory pays). Storages of parameters
  (``kv_up_weight``) are excluded: they exist whether or not backward runs.
- Communication: :func:`mindspeed_laga.comm.count_bytes`.
- FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` (matmul-family ops only;
  torch's CPU flash SDPA has no FLOP formula and counts 0).
- Time: median fwd+bwd wall time of the timed runs after the warm-up.
- Peak memory: ``max_memory_allocated`` above the inputs (after
  ``reset_peak_memory_stats``) on CUDA/NPU; on CPU, when asked
  (``cpu_peak=True``), the CPU allocator's peak above the inputs in one extra
  untimed pass under the profiler (:class:`mindspeed_laga.tools.cpu_peak.CpuPeak`),
  else None. :func:`peak_check` puts it beside the cost model's prediction
  (``costmodel.peak``).
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import api, comm
from .cases import DTYPES, INPUTS, Case, full_inputs, shard
from .cpu_peak import CpuPeak


class SavedBytes:
    """``with SavedBytes(exclude=[params]) as saved: ...``; then ``saved.bytes``."""

    def __init__(self, exclude=()):
        self._excluded = {_storage_key(t) for t in exclude}
        self.storages: Dict[tuple, dict] = {}
        self._ctx = None

    def _pack(self, t: torch.Tensor):
        key = _storage_key(t)
        if key not in self._excluded and key not in self.storages:
            self.storages[key] = {"bytes": t.untyped_storage().nbytes(), "shape": tuple(t.shape),
                                  "dtype": str(t.dtype).replace("torch.", "")}
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(s["bytes"] for s in self.storages.values())


def _storage_key(t: torch.Tensor) -> tuple:
    return (str(t.device), t.untyped_storage().data_ptr())


def _device():
    """Where this rank computes: the accelerator its process group drives, else the CPU."""
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    npu = getattr(torch, "npu", None)
    if npu is not None and dist.is_initialized() and dist.get_backend() == "hccl":
        return torch.device("npu", npu.current_device())
    return torch.device("cpu")


def device_type(backend=None) -> str:
    """The device a rank launched with ``backend`` (None: the best available) will use."""
    if backend in (None, "nccl") and torch.cuda.is_available():
        return "cuda"
    if backend in (None, "hccl") and getattr(torch, "npu", None) is not None:
        return "npu"
    return "cpu"


def default_backend() -> str:
    """The process-group backend of the best available device."""
    return {"cuda": "nccl", "npu": "hccl"}.get(device_type(), "gloo")


def set_local_device(backend: str, local_rank: int) -> None:
    """Bind this process to its accelerator before the process group starts."""
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    elif backend == "hccl":
        torch.npu.set_device(local_rank)


def _memory_api(device):
    if device.type == "cuda":
        return torch.cuda
    if device.type == "npu":
        return torch.npu
    return None


def _projection_weight(case: Case, device, dtype):
    """A stand-in query projection: [s, b, r] -> [s, b, n*(d_n+d_r)], r = 2*d_c."""
    s = case.shape
    g = torch.Generator().manual_seed(case.seed + 1)
    width = 2 * s.kv_lora_rank
    w = torch.randn(s.heads * (s.qk_head_dim + s.rope_dim), width, generator=g, dtype=torch.float64)
    return w.to(device, dtype).requires_grad_(), width


def run_on_rank(case: Case, rank: int, cp_size: int, group, repeat: int = 1, warmup: int = 0,
                count_flops: bool = False, device=None, ulysses_group=None,
                cpu_peak: bool = False) -> dict:
    """Forward+backward of one case on this rank, ``warmup + repeat`` times
    (``device``: where to run; default the device the process group drives, or the CPU;
    ``ulysses_group``: this rank's Ulysses group for ``cp_algo="hybrid"``;
    ``cpu_peak``: on CPU, one more untimed pass under the profiler measures
    ``peak_bytes``, else None there; every rank of ``group`` must pass the same value,
    the pass runs the collectives too). ``peak_reason`` says why ``peak_bytes`` is None."""
    device = torch.device(device) if device is not None else _device()
    dtype = DTYPES[case.dtype]
    full = full_inputs(case.shape, case.seed)
    grad_out = shard(full["grad_out"], case, rank, cp_size).to(device, dtype)
    fn = api.FORMS[case.form]
    cp_group = group if cp_size > 1 else None
    proj = _projection_weight(case, device, dtype) if case.spec.query_projection else None
    mem = _memory_api(device)
    times, result = [], None
    for i in range(warmup + repeat):
        local = _local_inputs(full, case, rank, cp_size, device, dtype)
        flops = _flop_counter() if count_flops and i == warmup + repeat - 1 else contextlib.nullcontext()
        if mem is not None:
            mem.synchronize()
            mem.reset_peak_memory_stats()
            base = mem.memory_allocated()
        saved = SavedBytes(exclude=[local["kv_up_weight"]] + ([proj[0]] if proj else []))
        with comm.count_bytes() as counter, flops as flop_mode:
            if dist.is_initialized() and cp_size > 1:
                dist.barrier(group=group)
            start = time.perf_counter()
            out = _forward(fn, local, case, cp_group, proj, saved, ulysses_group)
            out.backward(grad_out)
            if mem is not None:
                mem.synchronize()
            times.append(time.perf_counter() - start)
        result = {"out": out.detach().cpu(),
                  "grads": {k: v.grad.detach().cpu() for k, v in local.items()},
                  "comm": counter.summary(),
                  "design_bytes": {d: counter.design_bytes(d) for d in ("forward", "backward")},
                  "comm_seconds": _comm_seconds(counter),
                  "saved_bytes": saved.bytes,
                  "saved": list(saved.storages.values()),
                  "peak_bytes": (mem.max_memory_allocated() - base) if mem is not None else None,
                  "peak_reason": None if mem is not None else "not asked (cpu_peak=False)",
                  "flops": _flop_totals(flop_mode) if count_flops and i == warmup + repeat - 1 else None,
                  "wire_by_group": _wire_by_group(counter)}
    timed = times[warmup:] or times
    result["seconds"] = statistics.median(timed)
    result["seconds_runs"] = timed  # every timed run, in order: the spread beside the median
    if cpu_peak and mem is None:
        # After the timed runs: the profiler slows every op and must not touch the times.
        # The last run's graph (its leaves) goes before the window opens: a free of memory
        # allocated before the window has no size in the profiler's events.
        del out, local
        local = _local_inputs(full, case, rank, cp_size, device, dtype)
        with CpuPeak() as peak:
            out = _forward(fn, local, case, cp_group, proj, SavedBytes(), ulysses_group)
            out.backward(grad_out)
        result["peak_bytes"], result["peak_reason"] = peak.bytes, peak.reason
    return result


def _local_inputs(full, case: Case, rank: int, cp_size: int, device, dtype) -> dict:
    """This rank's shard of every input, a fresh leaf on ``device``."""
    return {k: shard(full[k], case, rank, cp_size).to(device, dtype).requires_grad_()
            for k in INPUTS}


def _forward(fn, local, case: Case, cp_group, proj, saved: SavedBytes, ulysses_group=None):
    """The attention call (saved tensors counted inside it only), optionally after a
    stand-in query projection, with the latent gather started before it (overlap)."""
    query = local["query"]
    kwargs = case.spec.options()
    if case.cu_seqlens is not None:
        kwargs["cu_seqlens"] = list(case.cu_seqlens)
    if ulysses_group is not None:
        kwargs["ulysses_group"] = ulysses_group
    # Without CP there is no gather to overlap: the case runs plain.
    if case.spec.overlap and cp_group is not None:
        from ..forms.latent_source import start_latent_gather
        kwargs["latent_gather"] = start_latent_gather(local["kv_latent"], local["k_pos_emb"],
                                                      cp_group=cp_group)
    if proj is not None:
        weight, width = proj
        s, b = query.shape[:2]
        x = torch.ones(s, b, width, dtype=query.dtype, device=query.device)
        # 0 * projection: the projection's compute (and its dq work in backward) runs,
        # the query the attention sees is unchanged, so the reference still applies.
        query = query + 0 * torch.nn.functional.linear(x, weight).view_as(query)
    with saved:
        return fn(query, local["kv_latent"], local["k_pos_emb"], local["kv_up_weight"],
                  softmax_scale=case.shape.softmax_scale, cp_group=cp_group, cp_algo=case.cp_algo,
                  layout=case.layout, causal=case.causal, kernel=case.kernel,
                  qk_head_dim=case.shape.qk_head_dim, v_head_dim=case.shape.v_head_dim, **kwargs)


def _data_totals(counter, key: str, value: str) -> Dict[str, float]:
    """A field of the data collectives' records summed per ``key`` (tag, group)."""
    out: Dict[str, float] = {}
    for r in counter.records:
        if r.kind in comm.DATA_KINDS:
            out[getattr(r, key)] = out.get(getattr(r, key), 0) + getattr(r, value)
    return out


def _wire_by_group(counter) -> Dict[str, int]:
    """Wire bytes by group ("cp"; hybrid: "ulysses", "ring")."""
    return _data_totals(counter, "group", "wire")


def _comm_seconds(counter) -> Dict[str, float]:
    """Blocked time in data collectives, by tag."""
    return _data_totals(counter, "tag", "seconds")


def _flop_counter():
    from torch.utils.flop_counter import FlopCounterMode
    return FlopCounterMode(display=False)


def _flop_totals(mode) -> dict:
    """{"total": n, "by_op": {op: n}} from a FlopCounterMode."""
    counts = mode.get_flop_counts().get("Global", {})
    return {"total": mode.get_total_flops(), "by_op": {str(k): v for k, v in counts.items()}}


def interleaved(cases: List[Case], run_one, repeat: int, warmup: int, count_flops: bool = False,
                cpu_peak: bool = False, progress=None) -> List[dict]:
    """Every case ``warmup + repeat`` times, one run of each case per round, so that a load
    that drifts during the bench lands on every case alike and shows as each one's spread
    (run back to back, one case could get the quiet minute and another the busy one).
    ``run_one(case, count_flops, cpu_peak)``: :func:`run_on_rank` with one timed run; the
    last round's result is kept (FLOPs and the CPU peak measured there), with every timed
    run's seconds."""
    rounds = warmup + repeat
    timed: List[List[float]] = [[] for _ in cases]
    results: List[dict] = [{} for _ in cases]
    for r in range(rounds):
        last = r == rounds - 1
        for i, case in enumerate(cases):
            results[i] = run_one(case, count_flops and last, cpu_peak and last)
            if r >= warmup:
                timed[i] += results[i]["seconds_runs"]
            if progress is not None and last:
                progress(i, case)
    for result, runs in zip(results, timed):
        result["seconds_runs"] = runs
        result["seconds"] = statistics.median(runs)
    return results


def worker(rank: int, cp_size: int, cases: List[Case], repeat: int = 1, warmup: int = 0,
           count_flops: bool = False, progress: bool = False, cpu_peak: bool = False,
           interleave: bool = False) -> List[dict]:
    """Entry point for :func:`mindspeed_laga.tools.spawn.run_on_ranks`: every run, in order
    (``cpu_peak``: see :func:`run_on_rank`; ``interleave``: the cases' runs in rounds,
    :func:`interleaved`, as bench times them).

    The one per-rank runner: :func:`worker`, ``verify``, ``bench`` and the
    tests all measure through it."""
    group = dist.group.WORLD if dist.is_initialized() else None
    if interleave:
        def run_one(case, flops, peak):
            return run_on_rank(case, rank, cp_size, group, 1, 0, flops, cpu_peak=peak)

        def say(i, case):
            if progress and rank == 0:
                print(f"  [{i + 1}/{len(cases)}] {case.spec.name} S={case.shape.seq_len} "
                      f"{case.cp_algo}", file=sys.stderr, flush=True)
        return interleaved(cases, run_one, repeat, warmup, count_flops, cpu_peak, say)
    out = []
    for i, case in enumerate(cases):
        out.append(run_on_rank(case, rank, cp_size, group, repeat, warmup, count_flops,
                               cpu_peak=cpu_peak))
        if progress and rank == 0:
            # progress on stderr: stdout may carry bench's JSON (--json -)
            print(f"  [{i + 1}/{len(cases)}] {case.spec.name} S={case.shape.seq_len} "
                  f"{case.cp_algo}", file=sys.stderr, flush=True)
    return out


def model_kernel(kernel: str, device_type: str) -> str:
    """The cost model's kernel kind of ``kernel`` run on ``device_type``: ``auto`` resolves
    as the forms resolve it; each kernel names its kind (``Kernel.model_kind``)."""
    from ..kernels.registry import model_kind
    return model_kind(kernel, device_type)


def shape_dims(shape):
    """The cost model's :class:`~mindspeed_laga.vocab.dims.ModelDims` of a case shape."""
    from ..vocab.dims import ModelDims
    return ModelDims(shape.heads, shape.qk_head_dim, shape.rope_dim, shape.v_head_dim,
                     shape.kv_lora_rank)


def case_config(case: Case, cp_size: int, device_type: str = "cpu"):
    """The cost model's :class:`costmodel.Config` of a case run on ``cp_size`` ranks of
    ``device_type`` (:func:`model_kernel`)."""
    from . import costmodel as cm
    s = case.shape
    bounds = case.cu_seqlens
    doc_lens = tuple(b - a for a, b in zip(bounds[:-1], bounds[1:])) if bounds else None
    return cm.Config(shape_dims(s), s.seq_len, s.batch, cp_size, 1, case.cp_algo, case.layout,
                     case.dtype, model_kernel(case.kernel, device_type), case.causal,
                     doc_lens=doc_lens, ulysses_degree=case.ulysses_degree)


def predicted_peak(case: Case, cp_size: int = 1, rank: int = 0, device_type: str = "cpu"):
    """The cost model's peak-memory terms (``costmodel.Term``) of a case at a rank."""
    from . import costmodel as cm
    return cm.form_cost(case_config(case, cp_size, device_type), case.spec, rank).peak


def peak_check(case: Case, device="cuda", rank: int = 0, cp_size: int = 1,
               group=None) -> Tuple[int, Optional[int]]:
    """(predicted, measured) peak bytes of one case's forward+backward above its inputs
    on ``device``: CUDA or NPU (``max_memory_allocated``) or CPU (the allocator's events
    under the profiler, :class:`mindspeed_laga.tools.cpu_peak.CpuPeak`; None where this torch's
    profiler has none). One process without CP by default; under a process group pass its
    rank, size, group (every rank calls it)."""
    device = torch.device(device)
    measured = run_on_rank(case, rank, cp_size, group, 1, 1, device=device, cpu_peak=True)["peak_bytes"]
    predicted = sum(t.bytes for t in predicted_peak(case, cp_size, rank, device.type))
    return predicted, measured

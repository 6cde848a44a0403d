"""Peak CPU memory of a block of code, read from the CPU allocator's own events.

CUDA and NPU keep allocator statistics (``max_memory_allocated`` after
``reset_peak_memory_stats``); the CPU allocator keeps none. PyTorch's profiler
with ``profile_memory=True`` records every CPU allocator allocation (``nbytes``
> 0) and free (< 0) as a ``"[memory]"`` event. The running sum of those events
in time order, at its maximum, is the peak above the level at profiler start:
what ``max_memory_allocated() - memory_allocated()`` (taken before) gives on
an accelerator, as long as nothing allocated before the start is freed inside
(such a free has no size in the events; torch warns once): drop what the
block would free before entering.

The events come from a private profiler API (``prof.profiler.kineto_results``);
present in torch 2.7 and 2.13. Where it is missing or the profiler cannot
start, ``bytes`` is None and ``reason`` says why; the block still runs.
The profiler slows every op: never time code inside it. Kineto (the profiler's
backend) prints lines such as ``profiler_start``/``profiler_stop`` to stderr on
every start; unless ``KINETO_LOG_LEVEL`` is set, its first start here runs
with the level that keeps them quiet (the environment is restored after).
"""
from __future__ import annotations

import os
from typing import Iterable, Optional, Tuple

import torch

MEMORY_EVENT = "[memory]"
# Kineto reads its log level once, when the profiler first starts: above its USDT level (5).
QUIET_KINETO_LOG_LEVEL = "6"


class CpuPeak:
    """``with CpuPeak() as peak: ...``; then ``peak.bytes`` (None: ``peak.reason``)."""

    def __init__(self):
        self.bytes: Optional[int] = None
        self.reason: Optional[str] = None
        self._prof = None

    def __enter__(self):
        if _profiler_running():
            # A second profiler would stop the first one's recording when it stops.
            self.reason = "another torch profiler is running"
            return self
        try:
            from torch.profiler import ProfilerActivity, profile
            prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            _start_quietly(prof)
        except Exception as exc:  # noqa: BLE001 - a profiler that cannot start measures nothing
            self.reason = f"the torch profiler did not start ({type(exc).__name__}: {exc})"
            return self
        self._prof = prof
        return self

    def __exit__(self, *exc):
        if self._prof is None:
            return False
        prof, self._prof = self._prof, None
        prof.__exit__(*exc)
        if exc[0] is None:
            self.bytes, self.reason = _peak_from(prof)
        return False


def _profiler_running() -> bool:
    enabled = getattr(torch._C._autograd, "_profiler_enabled", None)
    return bool(enabled()) if enabled is not None else False


def _start_quietly(prof) -> None:
    if "KINETO_LOG_LEVEL" in os.environ:
        prof.__enter__()
        return
    os.environ["KINETO_LOG_LEVEL"] = QUIET_KINETO_LOG_LEVEL
    try:
        prof.__enter__()
    finally:
        del os.environ["KINETO_LOG_LEVEL"]


def _peak_from(prof) -> Tuple[Optional[int], Optional[str]]:
    try:
        from torch._C._autograd import DeviceType
        events = prof.profiler.kineto_results.events()
        steps = [(e.start_ns(), e.nbytes()) for e in events
                 if e.name() == MEMORY_EVENT and e.device_type() == DeviceType.CPU]
    except (AttributeError, ImportError, TypeError) as exc:
        return None, (f"this torch ({torch.__version__}) has no profiler memory events "
                      f"(prof.profiler.kineto_results: {type(exc).__name__}: {exc})")
    return running_peak(nbytes for _, nbytes in sorted(steps, key=lambda s: s[0])), None


def running_peak(deltas: Iterable[int]) -> int:
    """The highest running sum of allocation deltas above the start (0 at the start)."""
    level = peak = 0
    for delta in deltas:
        level += delta
        peak = max(peak, level)
    return peak


"""Run a list of attention cases at one CP size and hand back each case's per-rank results:
in this process at CP = 1, else once on CP spawned gloo ranks (bounded by a timeout); then
check every case's output and grads against its reference, naming the cases that fail."""
from __future__ import annotations

from typing import Any, Callable, Iterable, List

from mindspeed_laga.tools.spawn import run_on_ranks


def per_case(run_case: Callable, worker: Callable, cp: int, cases: List[dict], *,
             npu_standin: bool = False, timeout_s: float = 600) -> List[List[Any]]:
    """``[[rank 0's result, rank 1's, ...] for each case]``.

    ``run_case(rank, cp, case, group)`` runs one case; ``worker(rank, cp, cases)`` runs them
    all on one spawned rank (a module-level function, so it can be spawned).
    ``npu_standin``: the CP = 1 run installs the torch_npu stand-in for its duration (the
    spawned ranks' ``run_case`` installs its own)."""
    if cp > 1:
        per_rank = run_on_ranks(worker, cp, cases, timeout_s=timeout_s)
        return [[per_rank[r][i] for r in range(cp)] for i in range(len(cases))]
    if not npu_standin:
        return [[run_case(0, 1, case, None)] for case in cases]
    from support import fake_torch_npu
    fake_torch_npu.install()
    try:
        return [[run_case(0, 1, case, None)] for case in cases]
    finally:
        fake_torch_npu.uninstall()


class ResultsByCP:
    """``results(cp)`` -> ``[(case, per-rank results)]`` for ``cases_for(cp)``, run once per CP
    size and kept for the module's other tests."""

    def __init__(self, cases_for: Callable, run_case: Callable, worker: Callable):
        self.cases_for, self.run_case, self.worker = cases_for, run_case, worker
        self.kept = {}

    def __call__(self, cp: int):
        if cp not in self.kept:
            cases = self.cases_for(cp)
            self.kept[cp] = list(zip(cases, per_case(self.run_case, self.worker, cp, cases)))
        return self.kept[cp]


def case_id(case: dict, *keys: str) -> str:
    """A case's name in a failure: its values of ``keys`` joined by "-" (``causal`` reads
    causal or full), then its options as ``k=v,...`` where it has any."""
    parts = [("causal" if case[k] else "full") if k == "causal" else str(case[k]) for k in keys]
    opts = ",".join(f"{k}={v}" for k, v in case["options"].items())
    return "-".join(parts + [opts] if opts else parts)


def max_abs_error(got, want) -> float:
    return (got - want).abs().max().item()


def assert_all_match(compared: Iterable, tolerance: float, error: Callable = max_abs_error):
    """``compared``: ``(name, (out, grads), (reference out, reference grads))`` per case.
    Every case's output and each reference grad lie within ``tolerance`` by
    ``error(got, want)`` (a NaN fails too); the failure names up to 20 of the cases."""
    failures = []
    for name, (out, grads), (ref_out, ref_grads) in compared:
        errs = {"out": error(out, ref_out)}
        errs.update({k: error(grads[k], ref_grads[k]) for k in ref_grads})
        if not all(e <= tolerance for e in errs.values()):
            failures.append(f"{name}: {errs}")
    assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} failing cases)"

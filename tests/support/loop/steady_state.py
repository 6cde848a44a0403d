"""The steady-state counts of a real training loop (recorded by the bootstrap, per rank).

For every iteration after the first (every MLA module past its warm-up call), per rank:

- each MLA layer call outside backward runs exactly its data collectives (``DATA`` of the
  CP algorithm: the latent's all-gather, plus the all-to-alls of Q and O where heads are
  split), at most one small int64 all-reduce beside them (the ranks' agreement), and no
  host read unless it is such an exchange;
- at most one call per micro-batch exchanges: a per-layer exchange fails;
- a recompute's MLA calls (inside backward) run their data collectives, no exchange and no
  host read;
- LAGA's backward runs each call's adjoint data collectives and nothing else, with no host
  read.
"""
from __future__ import annotations

from collections import Counter
from typing import Dict, List, Optional

# forward, backward data collectives of one MLA layer call, by LAGA's CP algorithm
DATA = {
    "allgather": (["all_gather"], ["reduce_scatter"]),
    "heads": (["all_gather", "all_to_all", "all_to_all"],
              ["reduce_scatter", "all_to_all", "all_to_all"]),
}
# sparse MLA (DSA) gathers [latent | rope | index key] once, whatever the algorithm
SPARSE = "allgather"
# the host's --context-parallel-algo -> LAGA's collectives (ulysses and hybrid split heads)
BY_HOST_ALGO = {"ulysses_cp_algo": "heads", "hybrid_cp_algo": "heads",
                "kvallgather_cp_algo": "allgather", "megatron_cp_algo": "allgather"}
EXCHANGE = ("all_reduce", "int64")


def _kinds(slot, exchange=False) -> List[str]:
    return sorted(kind for kind, dtype in slot["collectives"]
                  if ((kind, dtype) == EXCHANGE) == exchange)


def _by_index(steady: Dict[str, dict], prefix: str) -> Dict[int, dict]:
    return {int(region.split(".")[1]): slot for region, slot in steady.items()
            if region.startswith(prefix + ".")}


def check_rank(steady: Dict[str, dict], data: str, micro_batches: int,
               iterations: int) -> List[str]:
    """The problems of one rank's record (empty: steady); ``data``: a key of DATA. The
    record numbers the MLA calls outside backward over the whole run (``forward.<k>``), the
    backward and recompute after call k (``backward.<k>``, ``recompute.<k>``); each
    iteration makes the same number of calls."""
    forward, backward = DATA[data]
    calls = _by_index(steady, "forward")
    per_iteration, rest = divmod(len(calls), iterations)
    if iterations < 2 or not per_iteration or rest or sorted(calls) != list(range(len(calls))):
        return [f"{len(calls)} MLA calls recorded, not the same number in each of "
                f"{iterations} iterations"]
    backs, recomputes = _by_index(steady, "backward"), _by_index(steady, "recompute")
    problems = []
    for it in range(1, iterations):  # iteration 0 warms up
        span = range(it * per_iteration, (it + 1) * per_iteration)
        exchanging = 0
        for k in span:
            slot, region = calls[k], f"forward.{k} (iteration {it + 1})"
            exchanges = len(_kinds(slot, exchange=True))
            exchanging += exchanges > 0
            if exchanges > 1 or _kinds(slot) != sorted(forward):
                problems.append(f"{region}: collectives {slot['collectives']}")
            if not exchanges and slot["syncs"]:
                problems.append(f"{region}: host reads {slot['syncs']}")
        if exchanging > micro_batches:
            problems.append(f"iteration {it + 1}: {exchanging} calls exchanged, more than its "
                            f"{micro_batches} micro-batches")
        for k in span:
            recompute = recomputes.get(k)
            if recompute and (_kinds(recompute, exchange=True) or recompute["syncs"]):
                problems.append(f"recompute.{k}: {recompute}")
        got = sorted(kind for k in span for kind, _ in backs.get(k, {"collectives": []})
                     ["collectives"])
        reads = [backs[k]["syncs"] for k in span if k in backs and backs[k]["syncs"]]
        want = sorted(backward * per_iteration)
        if got != want or reads:
            problems.append(f"iteration {it + 1} backward: {dict(Counter(got))} (want "
                            f"{dict(Counter(want))}), host reads {reads}")
    return problems


def assert_steady_state(run, micro_batches: int, iterations: int,
                        data: Optional[str] = None) -> None:
    """Every rank of ``run`` (real_loop.LoopRun) in steady state (module docstring);
    ``data``: a key of DATA (None: from the run's --context-parallel-algo)."""
    if data is None:
        data = BY_HOST_ALGO[run.argv[run.argv.index("--context-parallel-algo") + 1]]
    problems = [f"rank {rank}: {p}" for rank, steady in enumerate(run.steady)
                for p in check_rank(steady, data, micro_batches, iterations)]
    assert run.steady and not problems, "\n".join(problems[:30]) or "no rank recorded"

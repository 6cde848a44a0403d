"""Ranks that disagree raise together: what one call did on a rank, and the check that every
rank raised the expected error before any data moved.

A worker spawned by ``run_on_ranks`` returns :func:`outcome` of its call (one per rank);
the test hands the ranks' outcomes to :func:`assert_raised_together`. A module of named
scenarios runs them all in one spawned job through :func:`scenario_reports`.
"""
from __future__ import annotations

import os
from typing import Callable, Mapping, NamedTuple, Optional, Sequence, Union

import pytest

from mindspeed_laga import agreement, count_bytes


class Outcome(NamedTuple):
    kind: Optional[str]   # the exception's type name; None when the call returned
    text: Optional[str]   # its message
    data_bytes: int       # data bytes the package moved before it (the handshake excluded)


def outcome(call, *args, setup=None, **kw) -> Outcome:
    """Run ``call(*args, **kw)`` on this rank after the other ranks are here (a barrier)
    and with the handshake's skip state cleared; ``setup(*args)`` runs first, outside the
    byte count. Any exception is reported, not raised, so the ranks stay in step."""
    import torch.distributed as dist
    agreement.reset()
    dist.barrier()
    if setup is not None:
        setup(*args)
    with count_bytes() as counter:
        try:
            call(*args, **kw)
        except Exception as exc:  # noqa: BLE001 -- the type is part of what is checked
            return Outcome(type(exc).__name__, str(exc), counter.bytes())
    return Outcome(None, None, counter.bytes())


Expected = Union[str, Sequence[str], Mapping[int, str]]


def assert_raised_together(outcomes: Sequence[Outcome], expected: Expected,
                           kind: str = "ValueError", moved_data: bool = False):
    """Every rank raised ``kind`` whose message holds ``expected`` (one text for all ranks,
    or one per rank), and moved no data bytes before it (``moved_data``: the scenario
    moves data before the call that raises, so the bytes are not checked)."""
    for rank, (raised, text, data_bytes) in enumerate(outcomes):
        want = expected if isinstance(expected, str) else expected[rank]
        assert raised == kind and want in text, (rank, raised, text)
        if not moved_data:
            assert data_bytes == 0, f"rank {rank} moved {data_bytes} data bytes before raising"


Scenarios = Mapping[str, tuple]  # {name: (call(rank, world), expected)}, call at module level


def reports_by_scenario(scenarios: Scenarios, setup: Optional[Mapping[str, Callable]] = None,
                        world: int = 2, timeout_s: float = 120) -> Mapping[str, list]:
    """{name: [rank 0's :class:`Outcome`, rank 1's, ...]}: every scenario's call, in name
    order, on ``world`` spawned ranks in one job; ``setup[name]`` runs before its call."""
    from mindspeed_laga.tools.spawn import run_on_ranks
    calls = {name: scenarios[name][0] for name in sorted(scenarios)}
    per_rank = run_on_ranks(_scenario_worker, world, calls, dict(setup or {}), timeout_s=timeout_s)
    return {name: [per_rank[r][name] for r in range(world)] for name in scenarios}


def _scenario_worker(rank, world, calls, setup):
    return {name: outcome(call, rank, world, setup=setup.get(name)) for name, call in calls.items()}


def scenario_reports(scenarios: Scenarios, setup: Optional[Mapping[str, Callable]] = None):
    """The module's fixture ``reports = scenario_reports(SCENARIOS)``: the
    :func:`reports_by_scenario` of its scenarios, one spawned job for all of its tests."""
    @pytest.fixture(scope="module")
    def reports():
        return reports_by_scenario(scenarios, setup)
    return reports


def report_and_leave(out_dir: str, rank: int, call, *args) -> None:
    """Write what ``call(*args)`` raised ("no error" when it returned) to ``out_dir``/rank<r>
    and leave the process at once: a peer stuck in a collective would never meet the
    end-of-job barrier (the job then fails with every rank unreported; read the files)."""
    try:
        call(*args)
        text = "no error"
    except Exception as exc:  # noqa: BLE001 -- the report is the text
        text = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(text)
    os._exit(0)

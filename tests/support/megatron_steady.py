"""Steady-state counts of the megatron-core patch while megatron trains (test_megatron_e2e.py).

:func:`counted_mla` opens the collective and host-sync counters (tests/support/
collectives.py, host_syncs.py) over LAGA's code only (tests/support/laga_regions.py): each
call of the patched ``MLASelfAttention.forward``, filed by step and layer
(``forward.<step>.<layer>``; a recompute inside backward: ``recompute.<step>``), and
LAGA's autograd backward functions (``backward.<step>``). The loss, the gradient reduction
and the optimizer are the host's and not counted. :func:`check` then says what breaks the
steady state from the second step on (every module past its first, warm-up call):

- the step's first layer call may exchange the ranks' agreement once (one small int64
  all-reduce) beside its data collectives;
- every later layer call: exactly its data collectives (allgather: the latent's
  all-gather; ulysses and hybrid add the all-to-alls of Q and O) and no host read;
- the backward: each layer's adjoint collectives and no host read; a recompute, no
  exchange and no host read.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List

import torch

DATA = {"allgather": (["all_gather"], ["reduce_scatter"]),
        "ulysses": (["all_gather", "all_to_all", "all_to_all"],
                    ["reduce_scatter", "all_to_all", "all_to_all"])}
DATA["hybrid"] = DATA["ulysses"]
EXCHANGE = ("all_reduce", "int64")


@contextlib.contextmanager
def counted_mla(layers: int):
    """Yields a dict filled on exit with {region: {"collectives": [(kind, dtype)], "syncs":
    {op: n}}} of the patched forward's calls made inside (``layers`` per step)."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from support.collectives import count_collectives
    from support.host_syncs import count_host_syncs
    from support.laga_regions import backward_regions

    patched, calls, out = MLASelfAttention.forward, [0], {}

    def step():
        return (calls[0] - 1) // layers

    with count_host_syncs(everywhere=False) as syncs, \
            count_collectives(regions=syncs, everywhere=False) as seen:
        def forward(self, *args, **kwargs):
            if torch._C._current_autograd_node() is not None:  # a recompute, inside backward
                region = f"recompute.{step()}"
            else:
                calls[0] += 1
                region = f"forward.{step()}.{(calls[0] - 1) % layers}"
            with syncs.region(region):
                return patched(self, *args, **kwargs)

        MLASelfAttention.forward = forward
        try:
            with backward_regions(syncs, lambda: f"backward.{step()}"):
                yield out
        finally:
            MLASelfAttention.forward = patched
    regions = {c.region for c in seen.calls} | set(syncs.by_region())
    out.update({region: dict(collectives=[(c.kind, str(c.dtype).replace("torch.", ""))
                                          for c in seen.select(region)],
                             syncs=syncs.by_op(region))
                for region in regions if region is not None})


def check(counts: Dict[str, dict], layers: int, steps: int, cp_algo: str) -> List[str]:
    """What breaks the steady state in ``counts`` (empty: nothing; module docstring)."""
    forward, backward = (sorted(k) for k in DATA[cp_algo])
    empty = dict(collectives=[], syncs={})
    problems = []
    for step in range(1, steps):
        for layer in range(layers):
            region = f"forward.{step}.{layer}"
            call = counts.get(region, empty)
            exchanges = sum(1 for c in call["collectives"] if tuple(c) == EXCHANGE)
            data = sorted(k for k, dtype in call["collectives"] if (k, dtype) != EXCHANGE)
            if data != forward or exchanges > (1 if layer == 0 else 0):
                problems.append(f"{region}: {call['collectives']}")
            if not exchanges and call["syncs"]:
                problems.append(f"{region}: host reads {call['syncs']}")
        recompute = counts.get(f"recompute.{step}", empty)
        if any(tuple(c) == EXCHANGE for c in recompute["collectives"]) or recompute["syncs"]:
            problems.append(f"recompute.{step}: {recompute}")
        back = counts.get(f"backward.{step}", empty)
        if sorted(k for k, _ in back["collectives"]) != sorted(backward * layers) \
                or back["syncs"]:
            problems.append(f"backward.{step}: {back}")
    return problems

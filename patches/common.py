"""What both host patches share: the first-call checks (shapes, the same weights), the
per-micro-batch agreement, the overlapped gather and the error an untested host raises.

Every CP rank runs the same modules in the same order, so the ranks check a module
in full on its first call (the warm-up: its row, and that every CP rank holds the
same ``kv_up_weight``, one more small exchange: a checksum), and after that agree
once per micro-batch (mindspeed_laga/agreement/): a module called again outside
backward opens the next micro-batch, whose first LAGA call exchanges; the others
exchange nothing and read nothing from the device.
"""
from __future__ import annotations

import functools
import os
from datetime import timedelta
from typing import Dict, Optional

import torch
import torch.distributed as dist

from mindspeed_laga import agreement, comm


def first_call(module) -> bool:
    """True on the module's first LAGA call (the ranks check shapes then), False after."""
    first = not getattr(module, "_laga_checked", False)
    module._laga_checked = True
    if first:
        settle_after_schedules()
    return first


# Megatron's schedules: each runs a step's micro-batches, or an evaluation's (forward_only)
SCHEDULES = ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
             "forward_backward_pipelining_with_interleaving")


def settle_after_schedules() -> None:
    """The CP ranks settle when a Megatron schedule returns, where the host steps: a
    forward-only pass (evaluation) is checked too. Installed on a module's first LAGA call,
    after the host's own patches, once; ``get_forward_backward_func`` reads the names."""
    try:
        from megatron.core.pipeline_parallel import schedules
    except ImportError:
        return
    for name in SCHEDULES:
        run = getattr(schedules, name, None)
        if run is not None and not getattr(run, "_laga_settles", False):
            setattr(schedules, name, _settling(run))


def _settling(run):
    @functools.wraps(run)
    def settling(*args, **kwargs):
        result = run(*args, **kwargs)
        agreement.settle()
        return result
    settling._laga_settles = True
    return settling


def agree_per_micro_batch(module, cp_group) -> Optional[bool]:
    """``check_ranks`` for this call of ``module``: True on its first call (checked in full),
    None after (the agreement protocol). Counts the call first (open_micro_batch), so the
    first module of each new micro-batch opens it on every rank alike."""
    first = first_call(module)
    open_micro_batch(module, cp_group)
    return True if first else None


def in_backward() -> bool:  # autograd's engine runs this: a recompute, which opens nothing
    return torch._C._current_graph_task_id() != -1


def open_micro_batch(module, cp_group) -> None:
    """The adapters' count of micro-batches: a module called again (outside backward) opens
    the next one (agreement.new_micro_batch); every rank calls its modules in one order."""
    if cp_group is None or comm.group_size(cp_group) == 1 or in_backward():
        return
    group = agreement.state(cp_group)
    if getattr(module, "_laga_epoch", None) == group.epoch:
        agreement.new_micro_batch(cp_group)  # the epoch moves on in the same record
    module._laga_epoch = group.epoch


def check_weight_once(first: bool, read_weight, cp_group, settings=None):
    """``read_weight()``: the kv_up_weight, returned. On a module's first call every CP rank
    must hold the same one (ValueError on every rank otherwise; one exchange of one int64,
    docs/RESULTS.md has its cost) and agree on ``settings`` ({name: (value, choices)}, in
    the same exchange). The weight is read after the ranks met: a rank whose read raises
    (an adapter LAGA cannot read, on that rank only) sends its error in that exchange, so
    its peers raise with it at once instead of waiting for it in :func:`meet_peers`."""
    if not first:
        return read_weight()
    meet_peers(cp_group)
    weight = failure = None
    try:
        weight = read_weight()
    except Exception as exc:  # noqa: BLE001 -- whatever failed, the peers must hear of it
        failure = exc
    agreement.check_same_weight(weight, cp_group, settings=settings, failure=failure)
    return weight


PEER_WAIT_ENV = "MINDSPEED_LAGA_PEER_WAIT_S"
_MEETINGS: Dict[tuple, int] = {}  # CP ranks -> first calls met so far (alike on every rank)


def meet_peers(cp_group) -> None:
    """Before a module's first exchange, every CP rank must reach it: through the process
    group's key-value store, not a collective, so a peer that runs something else (the
    patch missing on that rank: its original forward's all-gather) cannot abort this rank
    in gloo or mismatch silently. RuntimeError naming the absent ranks after
    ``MINDSPEED_LAGA_PEER_WAIT_S`` seconds (default 300)."""
    if cp_group is None or cp_group.size() == 1:
        return
    ranks = tuple(dist.get_process_group_ranks(cp_group))
    count = _MEETINGS[ranks] = _MEETINGS.get(ranks, 0) + 1
    key = f"mindspeed_laga/first_call/{'-'.join(map(str, ranks))}/{count}"
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{key}/{dist.get_rank()}", "1")
    wait_s = float(os.environ.get(PEER_WAIT_ENV, "300"))
    try:
        store.wait([f"{key}/{r}" for r in ranks], timedelta(seconds=wait_s))
    except Exception:  # noqa: BLE001 -- the store's timeout error type differs by release
        absent = [r for r in ranks if not store.check([f"{key}/{r}"])]
        raise RuntimeError(
            f"mindspeed_laga: CP rank(s) {absent} (global) did not reach LAGA's first call of "
            f"this module within {wait_s:g} s ({PEER_WAIT_ENV}); LAGA's patch must be applied "
            "on every rank before the first forward (patch_megatron_mla / the launcher), or "
            "those ranks are stalled") from None


def start_gather(overlap: bool, kv_latent, k_pos_emb, cp_group, check_ranks: bool) -> Optional[object]:
    """With overlap, launch the latent all-gather now (the query projection hides it); else None."""
    if not overlap:
        return None
    from mindspeed_laga import start_latent_gather
    return start_latent_gather(kv_latent, k_pos_emb, cp_group=cp_group, check_ranks=check_ranks)


class UnsupportedHostError(RuntimeError):
    """The installed host differs from every version the patch was written for."""

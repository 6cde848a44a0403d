"""A local failure in a call that exchanges nothing, told to the peers through the process
group's key-value store (no collective): the failing rank leaves its message and raises;
a peer whose data collective then fails (gloo: as soon as the failing process has left;
NCCL/HCCL: at the backend's timeout) raises that message, naming the rank, instead of the
backend's error. Such calls are counted per group alike on every rank, so a message is read
only for the call it belongs to. The counts die with their group (weak keys)."""
from __future__ import annotations

import weakref
from typing import Optional

import torch.distributed as dist

_CALLS: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
# Why a call exchanged nothing, by the schedule's mode: every rank had passed
# check_ranks=False, or it was a later call of a micro-batch.
WHY = {"skip": "every rank had passed check_ranks=False",
       "fold": "a later call of a micro-batch, agreed at the next exchange or settle"}


def _key(group, call: int) -> str:
    ranks = "-".join(map(str, dist.get_process_group_ranks(group)))
    return f"mindspeed_laga/skipped_call_failure/{ranks}/{call}"


def count(group) -> None:
    """One more call of ``group`` exchanged nothing (every rank counts it)."""
    _CALLS[group] = _CALLS.get(group, 0) + 1


def tell_peers(failure: BaseException, group, mode: str) -> BaseException:
    """Leave ``failure``'s message for the peers of this call; returns it with a note of
    why the peers learn it late (``mode``: a key of WHY)."""
    text = str(failure) if isinstance(failure, ValueError) else \
        f"{type(failure).__name__}: {failure}"
    note = (f"(a call that exchanged nothing before its data collective: {WHY[mode]}; so the "
            "CP peers learn of this only when that collective fails; pass check_ranks=True to "
            "have every rank raise before any data moves)")
    if failure.args and isinstance(failure.args[0], str):
        failure.args = (f"{failure.args[0]} {note}",) + failure.args[1:]
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(_key(group, _CALLS.get(group, 0)), f"{dist.get_rank(group)}\n{mode}\n{text}")
    except Exception:  # noqa: BLE001 -- telling is best effort: the failure itself must raise
        pass
    return failure


def peer_failure(group) -> Optional[ValueError]:
    """The error a peer left for this rank's current such call of ``group``, or None."""
    try:
        if group is None or group not in _CALLS:
            return None
        key = _key(group, _CALLS[group])
        store = dist.distributed_c10d._get_default_store()
        if not store.check([key]):
            return None
        rank, mode, text = store.get(key).decode(errors="replace").split("\n", 2)
    except Exception:  # noqa: BLE001 -- no message to read: the backend's error stands
        return None
    return ValueError(f"CP rank(s) [{rank}] rejected their arguments in a call that exchanged "
                      f"nothing before its data collective ({WHY.get(mode, mode)}), so this rank "
                      f"learnt of it when that collective failed: CP rank {rank}: {text}")

"""A local failure in a call that skipped the cross-rank exchange, and how its peers learn it.

Once every rank passed ``check_ranks=False`` a group's calls exchange nothing before
their data collectives: no collective and no host sync, which is the point. A rank
whose local checks then fail (arguments that differ on that rank only) cannot stop its
peers from entering the call's first data collective; only a host sync per call could,
and that is the exchange skipped. So the failing rank leaves its message in the process
group's key-value store (no collective) and raises; a peer whose data collective then
fails (gloo: as soon as the failing process has left; NCCL/HCCL: at the backend's
timeout, or when the launcher stops the job) raises that message, naming the rank,
instead of the backend's "Connection closed". Calls are counted per group on every rank
alike (every rank skips the same calls), so a message is read only for the call it
belongs to.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch.distributed as dist

_CALLS: Dict[Tuple[int, ...], int] = {}  # group's ranks -> calls that skipped the exchange
NOTE = ("(a call that skipped the cross-rank exchange: every rank had passed check_ranks=False, "
        "so the CP peers learn of this only when their data collective fails; pass "
        "check_ranks=True or None to have every rank raise before any data moves)")


def _ranks(group) -> Tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _key(ranks: Tuple[int, ...], call: int) -> str:
    return f"mindspeed_laga/skipped_call_failure/{'-'.join(map(str, ranks))}/{call}"


def count(group) -> None:
    """One more call of ``group`` skipped the exchange (every rank counts it)."""
    ranks = _ranks(group)
    _CALLS[ranks] = _CALLS.get(ranks, 0) + 1


def tell_peers(failure: BaseException, group) -> BaseException:
    """Leave ``failure``'s message for the peers of this call; returns it with the note."""
    text = str(failure) if isinstance(failure, ValueError) else \
        f"{type(failure).__name__}: {failure}"
    if failure.args and isinstance(failure.args[0], str):
        failure.args = (f"{failure.args[0]} {NOTE}",) + failure.args[1:]
    ranks = _ranks(group)
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(_key(ranks, _CALLS.get(ranks, 0)), f"{dist.get_rank(group)}\n{text}")
    except Exception:  # noqa: BLE001 -- telling is best effort: the failure itself must raise
        pass
    return failure


def peer_failure(group) -> Optional[ValueError]:
    """The error a peer left for this rank's current skipped call of ``group``, or None."""
    if group is None:
        return None
    try:
        ranks = _ranks(group)
        if ranks not in _CALLS:
            return None
        key = _key(ranks, _CALLS[ranks])
        store = dist.distributed_c10d._get_default_store()
        if not store.check([key]):
            return None
        rank, text = store.get(key).decode(errors="replace").split("\n", 1)
    except Exception:  # noqa: BLE001 -- no message to read: the backend's error stands
        return None
    return ValueError(f"CP rank(s) [{rank}] rejected their arguments in a call that skipped the "
                      "cross-rank exchange (every rank had passed check_ranks=False), so this "
                      f"rank learnt of it when its data collective failed: CP rank {rank}: {text}")

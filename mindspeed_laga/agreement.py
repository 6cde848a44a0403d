"""When the CP ranks agree: once per micro-batch, and a verdict on every other call.

The exchange itself (one row of int64 per rank, raising alike on every rank) is
``handshake.py``'s; this module decides *which* calls run it, the same way on every
rank and without communicating:

- **Per-call mode** (a group that never saw :func:`new_micro_batch`): every call
  exchanges, until an exchange shows every rank passing ``check_ranks=False``; then the
  group skips (``handshake.skips``). This is what a direct caller of the forms gets.
- **Micro-batch mode** (after :func:`new_micro_batch` on the group, which every rank
  calls alike; the adapters call it themselves): the first call of each micro-batch
  exchanges its full row, before its first data collective, so shapes that would hang
  or abort a collective are agreed then. Every later call of that micro-batch exchanges
  nothing and reads nothing from the device: it folds a hash of its host-side row
  (shapes, options, kernels, the host codes of its documents and key padding) into a
  running digest. The digests travel in the next exchange (the next micro-batch's
  first call) and in :func:`settle`, which also runs before every torch optimizer
  step: ranks whose later calls differed raise together, before the update.

Why that is sound: every CP rank runs the same modules in the same order, so it folds
the same rows in the same order when nothing differs, and the digests are equal;
any row a rank sees differently (a value only it has, or a call only it makes) changes
its digest, so the next exchange or the settle before the optimizer step raises on
every rank, naming the differing field. A local failure in a call that exchanges
nothing cannot stop the peers' data collective; it is told through the process
group's store (``skipped.py``) as in a skipped call. Content that lives on the device
(key padding, document boundaries held in a tensor) is read once per micro-batch, at
the exchange, and recognised on later calls by its tensor's metadata (storage,
offset, shape, stride, version counter: no device read), which a recompute's
``detach`` keeps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import comm, handshake, skipped

EXCHANGE, FOLD, SKIP = "exchange", "fold", "skip"


@dataclass
class GroupAgreement:
    """What one CP group's ranks have agreed on, alike on every rank."""

    epoch: int = 0                 # micro-batches opened (new_micro_batch)
    agreed_epoch: int = -1         # the epoch whose exchange ran
    settled_epoch: int = 0         # the epoch of the last settle
    digest: int = 0                # rows folded since the last exchange or settle
    folded: int = 0                # how many
    rows: List[Tuple[int, ...]] = field(default_factory=list)  # distinct rows, in order
    device: Optional[torch.device] = None  # where the last exchange ran
    memo: Dict[tuple, object] = field(default_factory=dict)    # device reads of this epoch
    deferred: Optional[BaseException] = None  # an adapter's local failure for the next call
    folding: bool = False          # a FOLD call is building its row now
    # the distinct key-padding contents of this micro-batch, hashed on the device: (OR, AND)
    # of their codes (a set: a tensor reused and an equal one built anew count alike)
    content: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    seeds: List[torch.Tensor] = field(default_factory=list)  # the exchanging call's codes

    @property
    def per_micro_batch(self) -> bool:
        return self.epoch > 0


_STATES: Dict[object, GroupAgreement] = {}
_MIX = (1 << 61) - 1


def state(cp_group) -> GroupAgreement:
    return _STATES.setdefault(cp_group, GroupAgreement())


def reset(cp_group=None) -> None:
    """Forget every group's agreement (None) or one group's; call on every rank."""
    if cp_group is None:
        _STATES.clear()
    else:
        _STATES.pop(cp_group, None)


def new_micro_batch(cp_group) -> None:
    """Open the next micro-batch on ``cp_group`` (on every rank alike): its next LAGA call
    exchanges the full row; the calls after it exchange nothing (module docstring)."""
    if cp_group is None or comm.group_size(cp_group) == 1:
        return
    group = state(cp_group)
    group.epoch += 1
    group.memo.clear()
    group.deferred = None
    _install_optimizer_hook()


def in_backward() -> bool:
    """Whether autograd's engine is running this code: an activation recompute (the forward
    run again inside backward), which opens no micro-batch."""
    return torch._C._current_graph_task_id() != -1


def open_micro_batch(module, cp_group) -> None:
    """The adapters' counter: a module called again in the current micro-batch (outside
    backward) means the next one began. Every CP rank calls its modules in the same order,
    so every rank opens the same micro-batches, without communicating."""
    if cp_group is None or comm.group_size(cp_group) == 1 or in_backward():
        return
    group = state(cp_group)
    seen = getattr(module, "_laga_epoch", None)
    if seen is not None and seen == group.epoch:
        new_micro_batch(cp_group)
    module._laga_epoch = group.epoch


def decide(cp_group, check_ranks) -> str:
    """EXCHANGE, FOLD or SKIP for a call on a group of size > 1 (the same on every rank)."""
    if check_ranks is True:
        return EXCHANGE
    group = _STATES.get(cp_group)
    if group is not None and group.per_micro_batch and check_ranks is None:
        return FOLD if group.agreed_epoch == group.epoch else EXCHANGE
    return SKIP if handshake.skips(cp_group) else EXCHANGE


def defer_failure(cp_group, failure: BaseException) -> None:
    """An adapter's local check failed before the core call: the core call of this layer
    reports it (exchanged, or told through the store) instead of this rank raising alone."""
    group = state(cp_group)
    if group.deferred is None:
        group.deferred = failure


def agree_call(cp_group, check_ranks, failure, device, row: Callable[[], Dict[str, int]],
               names=None, details: Optional[Dict[str, object]] = None) -> None:
    """The agreement of one call of a form or ``start_latent_gather`` on a group of size > 1.

    ``row()``: the values every rank must agree on (keys of ``handshake.FIELDS``), built
    from host-side facts only; ``details``: per field, this rank's full value behind a
    code (a list, or a function returning it), read only when ranks differ. Raises ``failure`` (this rank's, or a deferred
    one) after the peers learnt of it.
    """
    group = state(cp_group)
    failure, group.deferred = failure or group.deferred, None
    how = decide(cp_group, check_ranks)
    if how == SKIP:
        handshake.agree({}, failure, cp_group, device)
        return
    if how == FOLD:
        skipped.count(cp_group)
        if failure is not None:
            raise skipped.tell_peers(handshake.as_exception(failure), cp_group)
        group.folding = True
        try:
            values = row()
        finally:
            group.folding = False
        _fold(group, values)
        return
    group.seeds = []
    values = row() if failure is None else _row_or_empty(row)
    values["calls"] = group.digest
    handshake.agree(values, failure, cp_group, device, names=names, force=True,
                    details=details if failure is None else None,
                    on_calls=_explain_calls(group), content=_content_value(group))
    group.agreed_epoch, group.device = group.epoch, torch.device(device)
    _clear(group)
    group.content = None  # a new micro-batch's set, seeded with what this call exchanged
    for code in group.seeds:
        _add_content(group, code)


def settle(cp_group=None) -> None:
    """Exchange the digests of the calls since the last exchange (every group in micro-batch
    mode when ``cp_group`` is None) and raise on every rank when they differ. Runs before
    every torch optimizer step; call it on every rank alike."""
    groups = [cp_group] if cp_group is not None else list(_STATES)
    for key in groups:
        group = _STATES.get(key)
        if group is None or not group.per_micro_batch or group.settled_epoch == group.epoch:
            continue
        group.settled_epoch = group.epoch  # before the exchange: a raise leaves it settled
        device = group.device or handshake.exchange_device("meta", key)
        values = {"stage": handshake.STAGES.index("settle"), "calls": group.digest}
        handshake.agree(values, None, key, device, force=True,
                        on_calls=_explain_calls(group), content=_content_value(group))
        _clear(group)


def memo(cp_group, key: tuple, read: Callable[[], object]):
    """``read()`` once per micro-batch for ``key`` (a tensor's metadata and what is read of
    it): later calls of the micro-batch reuse the value without touching the device. In
    per-call mode nothing is kept (every call exchanges and reads anyway)."""
    group = _STATES.get(cp_group) if cp_group is not None else None
    if group is None or not group.per_micro_batch:
        return read()
    if key not in group.memo:
        group.memo[key] = read()
    return group.memo[key]


def content_code(cp_group, kind: str, t: torch.Tensor, host_code: Callable[[], int]) -> int:
    """The agreement's code of ``t``'s content (key padding).

    In a call that exchanges: ``host_code()``, read once per micro-batch (:func:`memo`),
    and in micro-batch mode the content hashed on the device too, to seed the
    micro-batch's set of contents. In a call that exchanges nothing the row holds
    ``handshake.CONTENT``: a tensor already seen in this micro-batch costs nothing (the
    adapters' steady state), and one first seen here is hashed on the device into the
    set, with no read. The set travels in the next exchange or settle, so ranks that
    pass other contents raise, and ranks that pass equal ones agree whether they reuse a
    tensor or build a new one."""
    group = _STATES.get(cp_group) if cp_group is not None else None
    key = (kind,) + tensor_key(t)
    if group is None or not group.per_micro_batch:
        return host_code()
    if not group.folding:
        group.seeds.append(device_code(t))
        return memo(cp_group, key, host_code)
    if key not in group.memo:
        group.memo[key] = handshake.CONTENT
        _add_content(group, device_code(t))
    return handshake.CONTENT


def _add_content(group: GroupAgreement, code: torch.Tensor) -> None:
    """OR and AND of the codes: equal for two sets of codes only when they are the same set
    (barring a collision of 64-bit hashes), whatever the order or repeats."""
    if group.content is None:
        group.content = (code, code)
    else:
        group.content = (group.content[0] | code, group.content[1] & code)


def _content_value(group: GroupAgreement) -> Optional[torch.Tensor]:
    """The set as the one int64 an exchange carries (None: no content this micro-batch)."""
    if group.content is None:
        return None
    union, common = group.content
    return union ^ (common * _ODD)


_WEIGHTS: Dict[tuple, torch.Tensor] = {}


def device_code(t: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 device tensor hashing ``t``'s values (bool or integer) with a pseudo-random
    64-bit weight per position (int64 arithmetic wraps): no host read. Random weights make
    two different tensors collide with probability about 2**-64 (a weight per position that
    is a small integer would let other padding patterns sum alike)."""
    flat = t.detach().reshape(-1).to(torch.int64)
    key = (flat.device, flat.numel())
    if key not in _WEIGHTS:
        pos = torch.arange(1, flat.numel() + 1, dtype=torch.int64, device=flat.device)
        mixed = pos * _GOLDEN
        mixed = mixed ^ (mixed >> 29)
        _WEIGHTS[key] = (mixed * _ODD) | 1
    return (flat * _WEIGHTS[key]).sum() + flat.numel()


_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_ODD = 0x632BE59BD9B4E019


def tensor_key(t: torch.Tensor) -> tuple:
    """A tensor's identity without a device read: its storage, view and version counter
    (an in-place edit bumps the version; ``detach`` keeps all of them)."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            t.stride(), t.dtype, t._version)


def _fold(group: GroupAgreement, values: Dict[str, int]) -> None:
    row = handshake.row_of(values)
    group.digest = (group.digest * 1000003 + hash(row)) % _MIX
    group.folded += 1
    if row not in group.rows:
        group.rows.append(row)


def _clear(group: GroupAgreement) -> None:
    group.digest, group.folded, group.rows = 0, 0, []


def _row_or_empty(row) -> Dict[str, int]:
    """A failed rank still sends what it can (the peers name it as rejecting)."""
    try:
        return row()
    except Exception:  # noqa: BLE001 -- the failure itself is what the peers hear
        return {}


def _explain_calls(group: GroupAgreement):
    """What this rank sends when the digests differ: its distinct folded rows, flattened."""
    def rows() -> List[int]:
        return [v for row in group.rows for v in row]
    return rows


def _install_optimizer_hook() -> None:
    global _HOOKED
    if _HOOKED:
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: settle())
    _HOOKED = True


_HOOKED = False

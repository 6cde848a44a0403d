"""When a call exchanges, records or skips: the same decision on every rank, without
communicating (docs/DESIGN.md, "Handshake").

- Per-call mode (a group that never opened a micro-batch): every call exchanges, until an
  exchange shows every rank passing ``check_ranks=False``; then the group skips.
- Micro-batch mode (after :func:`new_micro_batch` on every rank): the first call of a
  micro-batch exchanges its row before its first data collective; each later call reads
  nothing from the device and records its row (a bounded sequence, a digest) and its key
  padding's content (a device digest), for the next exchange or :func:`settle`.

State lives per process group under a weak key: it dies with its group.
"""
from __future__ import annotations

import contextlib
import enum
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import comm
from . import store
from .content import ODD, device_code, tensor_key, values_code
from .fields import CONTENT, FIELDS, FLAGS, STAGES, row_of
from .wire import as_exception, exchange, exchange_device

ROWS_KEPT = 256  # later-call rows kept per micro-batch to name a difference (the digest: all)
_MIX = (1 << 61) - 1
_MIX_CALL = 1000033


class Mode(str, enum.Enum):
    EXCHANGE = "exchange"
    FOLD = "fold"   # a later call: recorded, exchanged at the next exchange or settle
    SKIP = "skip"   # check_ranks=False on every rank: nothing exchanged, nothing recorded


@dataclass
class GroupAgreement:
    """What one CP group's ranks have agreed on, alike on every rank."""

    epoch: int = 0                 # micro-batches opened (new_micro_batch)
    agreed_epoch: int = -1         # the epoch whose exchange ran
    settled_epoch: int = 0         # the epoch of the last settle
    skips: bool = False            # every rank chose check_ranks=False in an exchange
    digest: int = 0                # of the rows recorded since the last exchange or settle
    rows: List[Tuple[int, ...]] = field(default_factory=list)  # their first ROWS_KEPT
    content: Optional[torch.Tensor] = None  # device digest of their key-padding contents
    flags: Optional[torch.Tensor] = None    # device bits of inputs found wrong (FLAGS)
    device: Optional[torch.device] = None   # where the last exchange ran
    memo: Dict[tuple, object] = field(default_factory=dict)  # this micro-batch's reads
    deferred: Optional[BaseException] = None  # an adapter's local failure for the next call
    folding: bool = False          # a later call is building its row now
    call_code: Optional[int] = None  # this later call's in-band code (None: it exchanged)
    later: int = 0                 # later calls since the last exchange or settle
    call_values: Optional[torch.Tensor] = None  # its device code of weights, FP8 scales
    call_grads: bool = False       # whether this later call's inputs need grads
    wires: List[tuple] = field(default_factory=list)    # this micro-batch's (kind, gathered)
    pattern: List[tuple] = field(default_factory=list)  # the previous micro-batch's
    failure: Optional[str] = None  # a later call's local failure, told at the next settle

    @property
    def per_micro_batch(self) -> bool:
        return self.epoch > 0


_STATES: "weakref.WeakKeyDictionary[object, GroupAgreement]" = weakref.WeakKeyDictionary()
# The leaf tensors behind the weights LAGA calls used (by id): an optimizer stepping one
# of them is the model's, which steps on every rank alike; another (an auxiliary one, on
# one rank) settles nothing.
_WEIGHTS: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def state(cp_group) -> GroupAgreement:
    return _STATES.get(cp_group) or _STATES.setdefault(cp_group, GroupAgreement())


def reset(cp_group=None) -> None:
    """Exchange again on every call of ``cp_group`` (all groups when None), in per-call mode
    until the group opens a micro-batch again; call on every rank."""
    if cp_group is None:
        _STATES.clear()
    else:
        _STATES.pop(cp_group, None)


def skips(cp_group) -> bool:
    """Whether this group's calls skip the exchange (every rank chose check_ranks=False)."""
    found = _STATES.get(cp_group)
    return found is not None and found.skips


def new_micro_batch(cp_group) -> None:
    """Open the next micro-batch on ``cp_group`` (every rank alike): its next LAGA call
    exchanges the full row; the calls after it exchange nothing."""
    if cp_group is None or comm.group_size(cp_group) == 1:
        return
    group = state(cp_group)
    group.epoch += 1
    group.memo.clear()
    group.pattern, group.wires = group.wires or group.pattern, []
    group.deferred = None
    _install_optimizer_hook()


def in_backward() -> bool:  # autograd's engine runs this: a recompute, which opens nothing
    return torch._C._current_graph_task_id() != -1


def open_micro_batch(module, cp_group) -> None:
    """The adapters' counter: a module called again in the current micro-batch (outside
    backward) means the next one began; every rank calls its modules in the same order."""
    if cp_group is None or comm.group_size(cp_group) == 1 or in_backward():
        return
    group = state(cp_group)
    if getattr(module, "_laga_epoch", None) == group.epoch:
        new_micro_batch(cp_group)
    module._laga_epoch = group.epoch


def decide(cp_group, check_ranks) -> Mode:
    if check_ranks is True:
        return Mode.EXCHANGE
    group = _STATES.get(cp_group)  # False on one rank of a micro-batch: recorded, then named
    if group is not None and group.per_micro_batch and not (check_ranks is False and group.skips):
        return Mode.FOLD if group.agreed_epoch == group.epoch else Mode.EXCHANGE
    return Mode.SKIP if skips(cp_group) else Mode.EXCHANGE


def defer_failure(cp_group, failure: BaseException) -> None:
    """An adapter's local check failed before the core call: that call reports it."""
    group = state(cp_group)
    if group.deferred is None:
        group.deferred = failure


def agree_call(cp_group, check_ranks, failure, device, row: Callable[[], Dict[str, int]],
               names=None, details: Optional[Dict[str, object]] = None,
               values: Optional[Callable[[], list]] = None) -> None:
    """The agreement of one call on a group of size > 1: ``row()`` builds the call's values
    from host facts; raises ``failure`` (this rank's, or a deferred one) after the peers
    learnt of it (exchanged, or through the store). ``values()``: device tensors (a weight,
    FP8 scales) a later call folds into its in-band code (inband.py), unread."""
    group = state(cp_group)
    failure, group.deferred = failure or group.deferred, None
    how = decide(cp_group, check_ranks)
    if how is not Mode.EXCHANGE:
        store.count(cp_group)
        group.later += 1
        group.call_code = group.later * _MIX_CALL % _MIX  # SKIP: no row
        group.call_values, group.call_grads = None, False
        if failure is not None:
            group.failure = group.failure or str(as_exception(failure))
            raise store.tell_peers(as_exception(failure), cp_group, how.value)
        if how is Mode.FOLD:
            group.folding = True
            try:
                _record(group, row())
                group.call_values = values_code(values()) if values is not None else None
            finally:
                group.folding = False
        return
    group.call_code = group.call_values = None
    failure = failure or group.failure  # a later call's, told now
    try:  # a failed rank still sends what it can (the peers name it as rejecting)
        values = row()
    except Exception:  # noqa: BLE001 -- the failure itself is what the peers hear
        if failure is None:
            raise
        values = {}
    values["calls"] = group.digest
    with _forget_shapes(group):
        table = exchange(values, failure, cp_group, device, names=names,
                         details=details if failure is None else None,
                         later=_later_rows(group), content=group.content, flags=group.flags)
    if all(r[FIELDS.index("check_ranks")] == 0 for r in table):
        group.skips = True  # until reset: an explicit check_ranks=True still exchanges
    group.agreed_epoch, group.device = group.epoch, torch.device(device)
    _clear(group)


def settle(cp_group=None) -> None:
    """Exchange the digests of the later calls since the last exchange (every group in
    micro-batch mode when ``cp_group`` is None); raise on every rank when they differ.
    Call it on every rank alike: where the loop steps, and after a forward-only pass."""
    groups = [cp_group] if cp_group is not None else list(_STATES.keys())
    for key in groups:
        group = _STATES.get(key)
        if group is None or (group.flags is None and group.failure is None and (
                not group.per_micro_batch or group.settled_epoch == group.epoch)):
            continue
        group.settled_epoch = group.epoch  # before the exchange: a raise leaves it settled
        device = group.device or exchange_device("meta", key)
        values = {"stage": STAGES.index("settle"), "calls": group.digest}
        try:
            with _forget_shapes(group):
                exchange(values, group.failure, key, device, later=_later_rows(group),
                         content=group.content, flags=group.flags)
        finally:
            _clear(group)


@contextlib.contextmanager
def _forget_shapes(group: GroupAgreement):
    """An exchange that raises forgets the gathers' shapes (inband.py) on every rank alike:
    the ranks' micro-batches differed, so they set no pattern for the next one."""
    try:
        yield
    except BaseException:
        group.pattern, group.wires = [], []
        raise


def memo(cp_group, key: tuple, read: Callable[[], object]):
    """``read()`` once per micro-batch for ``key`` (per-call mode: every call reads)."""
    group = _STATES.get(cp_group) if cp_group is not None else None
    if group is None or not group.per_micro_batch:
        return read()
    if key not in group.memo:
        group.memo[key] = read()
    return group.memo[key]


def content_code(cp_group, kind: str, t: torch.Tensor, host_code: Callable[[], int]) -> int:
    """The row's code of ``t``'s content (key padding): ``host_code()`` in an exchanging call
    (read once per micro-batch); in a later call CONTENT, with the content hashed on the
    device (once per tensor in the micro-batch) and folded in call order into the
    micro-batch's digest: no read."""
    group = _STATES.get(cp_group) if cp_group is not None else None
    if group is None or not group.per_micro_batch:
        return host_code()
    if not group.folding:
        return memo(cp_group, (kind, "host") + tensor_key(t), host_code)
    code = memo(cp_group, (kind, "device") + tensor_key(t), lambda: device_code(t))
    group.content = code if group.content is None else group.content * ODD + code
    return CONTENT


def flag(cp_group, name: str, wrong: torch.Tensor) -> None:
    """Note on the device, unread, whether an input (a key of FLAGS) was found wrong: every
    rank of a call calls this alike; the next exchange or settle raises naming it."""
    if cp_group is None or comm.group_size(cp_group) == 1:
        return
    group, bit = state(cp_group), wrong.to(torch.int64) << list(FLAGS).index(name)
    group.flags = bit if group.flags is None else group.flags | bit


def _record(group: GroupAgreement, values: Dict[str, int]) -> None:
    row = row_of(values)
    group.digest = (group.digest * 1000003 + hash(row)) % _MIX
    group.call_code = (hash(row) * _MIX_CALL + group.later) % _MIX  # in band: this call
    group.call_grads = values.get("requires_grad", 0) > 0
    if len(group.rows) < ROWS_KEPT:
        group.rows.append(row)


def _clear(group: GroupAgreement) -> None:
    group.digest, group.rows, group.content, group.flags = 0, [], None, None
    group.failure, group.later = None, 0


def _later_rows(group: GroupAgreement):  # flattened, gathered only when digests differ
    return lambda: [v for row in group.rows for v in row]


def note_weight(weight) -> None:
    """Note the leaves ``weight`` is made of (itself, or a LoRA sum's parameters)."""
    nodes, seen = [getattr(weight, "grad_fn", None)], 0
    if nodes[0] is None and isinstance(weight, torch.Tensor) and weight.requires_grad:
        _WEIGHTS[id(weight)] = weight
    while nodes and seen < 64:  # a few nodes: a cast, a LoRA product and sum
        node, seen = nodes.pop(), seen + 1
        leaf = getattr(node, "variable", None)
        if leaf is not None:
            _WEIGHTS[id(leaf)] = leaf
        nodes.extend(n for n, _ in getattr(node, "next_functions", ()) if n is not None)


def _settle_for(optimizer, *_) -> None:
    """Before a torch optimizer steps the weights of LAGA calls: settle."""
    if any(_WEIGHTS.get(id(p)) is p for group in optimizer.param_groups
           for p in group["params"]):
        settle()


def _install_optimizer_hook(hooked=[]) -> None:  # noqa: B006 -- once per process
    if not hooked:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        hooked.append(register_optimizer_step_pre_hook(_settle_for))

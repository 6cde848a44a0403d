"""When a call exchanges, records or skips: the same decision on every rank, without
communicating (docs/DESIGN.md, "Handshake"). Per-call mode (no micro-batch opened): every
call exchanges. Micro-batch mode (after :func:`new_micro_batch`): a micro-batch's first call
exchanges; each later call records its row (a bounded sequence and a digest) and its key
padding's device digest, for the next exchange or :func:`settle`. State is weakly keyed
by its process group, so it dies with the group."""
from __future__ import annotations

import enum
import functools
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import comm
from .content import ODD, device_code, tensor_key
from .fields import CONTENT, FIELDS, FLAGS, STAGES, row_of
from .wire import as_exception, exchange, exchange_device

ROWS_KEPT = 256  # later-call rows (and gathers) kept per micro-batch; the digest covers all
_MIX, _MIX_CALL = (1 << 61) - 1, 1000033


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
    digest: int = 0                # of the later rows since the last exchange or settle
    rows: List[Tuple[int, ...]] = field(default_factory=list)  # their first ROWS_KEPT
    content: Optional[torch.Tensor] = None  # device digest of their key-padding contents
    flagged: List[tuple] = field(default_factory=list)  # (FLAGS index, device bool) found wrong
    device: Optional[torch.device] = None   # where the last exchange ran
    memo: Dict[tuple, object] = field(default_factory=dict)  # this micro-batch's reads
    deferred: Optional[BaseException] = None  # an adapter's local failure for the next call
    folding: bool = False          # a later call is building its row now
    later: int = 0                 # later calls since the last exchange or settle
    call_code: Optional[int] = None  # this later call's in-band code (None: it exchanged)
    call_values: Optional[torch.Tensor] = None  # its device code of weights, FP8 scales
    call_grads: bool = False       # whether its inputs need grads
    wires: List[tuple] = field(default_factory=list)    # this micro-batch's (kind, gathered)
    pattern: List[tuple] = field(default_factory=list)  # the previous micro-batch's
    failure: Optional[str] = None  # a later call's local failure, told at the next settle

    @property
    def per_micro_batch(self) -> bool:
        return self.epoch > 0


_STATES: "weakref.WeakKeyDictionary[object, GroupAgreement]" = weakref.WeakKeyDictionary()
# The leaves behind LAGA calls' weights (by id): an optimizer stepping one is the model's,
# stepped on every rank alike; another (an auxiliary one, on one rank) settles nothing.
_WEIGHTS: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def state(cp_group) -> GroupAgreement:
    return _STATES.get(cp_group) or _STATES.setdefault(cp_group, GroupAgreement())


def reset(cp_group=None) -> None:
    """Forget ``cp_group``'s agreement (all groups when None): it exchanges on every call
    until it opens a micro-batch again. Call on every rank."""
    _STATES.clear() if cp_group is None else _STATES.pop(cp_group, None)


def skips(cp_group) -> bool:
    """Whether this group's calls skip the exchange (every rank chose check_ranks=False)."""
    return cp_group in _STATES and _STATES[cp_group].skips


def new_micro_batch(cp_group) -> None:
    """Open the next micro-batch on ``cp_group`` (every rank alike): its next LAGA call
    exchanges the full row; the calls after it exchange nothing."""
    if cp_group is None or comm.group_size(cp_group) == 1:
        return
    group = state(cp_group)
    group.epoch, group.memo = group.epoch + 1, {}
    group.pattern, group.wires, group.deferred = group.wires or group.pattern, [], None
    _install_optimizer_hook()


def decide(cp_group, check_ranks) -> Mode:
    if check_ranks is True:
        return Mode.EXCHANGE
    group = _STATES.get(cp_group)  # False on one rank of a micro-batch: recorded, then named
    if group is not None and group.per_micro_batch and not (check_ranks is False and group.skips):
        return Mode.FOLD if group.agreed_epoch == group.epoch else Mode.EXCHANGE
    return Mode.SKIP if skips(cp_group) else Mode.EXCHANGE


def defer_failure(cp_group, failure: BaseException) -> None:
    """An adapter's local check failed before the core call: that call reports it."""
    state(cp_group).deferred = state(cp_group).deferred or failure


def agree_call(cp_group, check_ranks, failure, device, row: Callable[[], Dict[str, int]],
               names=None, details: Optional[Dict[str, object]] = None,
               values: Optional[Callable[[], list]] = None) -> None:
    """One call's agreement on a group of size > 1: ``row()`` builds its values from host
    facts; ``failure`` (this rank's, or a deferred one) raises after the peers learnt of it.
    ``values()``: device tensors (a weight, FP8 scales) a later call's in-band code hashes."""
    group = state(cp_group)
    failure, group.deferred = failure or group.deferred, None
    how = decide(cp_group, check_ranks)
    if how is not Mode.EXCHANGE:
        comm.count_skipped(cp_group)
        group.later += 1
        group.call_code = group.later * _MIX_CALL % _MIX  # SKIP: no row
        group.call_values, group.call_grads = None, False
        try:
            if failure is None and how is Mode.FOLD:
                group.folding = True
                _record(group, row())
                group.call_values = device_code(values(), sample=True) if values else None
        except Exception as exc:  # noqa: BLE001 -- a row that fails is this rank's failure
            failure = exc
        finally:
            group.folding = False
        if failure is not None:
            group.failure = group.failure or str(as_exception(failure))
            raise comm.tell_peers(as_exception(failure), cp_group, how.value)
        return
    group.call_code = group.call_values = None
    failure = failure or group.failure  # a later call's, told now
    try:  # a failed rank sends its message, not a row; a row that fails is its failure
        values = {} if failure is not None else row()
    except Exception as exc:  # noqa: BLE001 -- whatever failed, the peers must hear of it
        failure, values = exc, {}
    table = _exchange(group, cp_group, values, failure, device, names=names,
                      details=details if failure is None else None)
    if all(r[FIELDS.index("check_ranks")] == 0 for r in table):
        group.skips = True  # until reset: an explicit check_ranks=True still exchanges
    group.agreed_epoch, group.device = group.epoch, torch.device(device)


def settle(cp_group=None) -> None:
    """Exchange what the later calls since the last exchange recorded (every group in
    micro-batch mode when ``cp_group`` is None); raise on every rank when they differ.
    Call it on every rank alike: where the loop steps, and after a forward-only pass."""
    for key in [cp_group] if cp_group is not None else list(_STATES.keys()):
        group = _STATES.get(key)
        if group is None or (not group.flagged and group.failure is None and (
                not group.per_micro_batch or group.settled_epoch == group.epoch)):
            continue
        group.settled_epoch = group.epoch  # before the exchange: a raise leaves it settled
        _exchange(group, key, {"stage": STAGES.index("settle")}, group.failure,
                  group.device or exchange_device("meta", key))


def _exchange(group: GroupAgreement, cp_group, values, failure, device, **kw):
    """Exchange ``values`` with what the later calls since the last exchange left (their
    rows' digest, key padding and flags), which it then forgets."""
    values["calls"] = group.digest
    try:
        return exchange(values, failure, cp_group, device, content=group.content,
                        flags=_flags(group), later=lambda: [v for r in group.rows for v in r], **kw)
    except BaseException:  # the ranks' micro-batches differed: they set no pattern (inband.py)
        group.pattern, group.wires = [], []
        raise
    finally:
        group.digest, group.rows, group.content, group.flagged = 0, [], None, []
        group.failure, group.later = None, 0


def memo(cp_group, key: tuple, read: Callable[[], object]):
    """``read()`` once per micro-batch for ``key`` (per-call mode: every call reads)."""
    group = _STATES.get(cp_group) if cp_group is not None else None
    if group is None or not group.per_micro_batch:
        return read()
    if key not in group.memo:
        group.memo[key] = read()
    return group.memo[key]


def content_code(cp_group, kind: str, t: torch.Tensor, host_code: Callable[[], int]) -> int:
    """The row's code of ``t``'s content (key padding): ``host_code()``, read once per
    micro-batch, in an exchanging call; in a later call CONTENT, the content hashed on the
    device (once per tensor) and folded in call order into the micro-batch's digest."""
    group = _STATES.get(cp_group) if cp_group is not None else None
    if group is None or not group.per_micro_batch:
        return host_code()
    if not group.folding:
        return memo(cp_group, (kind, "host") + tensor_key(t), host_code)
    code = memo(cp_group, (kind, "device") + tensor_key(t), lambda: device_code(t))
    group.content = code if group.content is None else group.content * ODD + code
    return CONTENT


def flag(cp_group, name: str, wrong: torch.Tensor) -> None:
    """Note on the device, unread, whether an input (a key of FLAGS) was found wrong; the
    next exchange or settle raises naming it. Every rank of a call calls this alike."""
    if cp_group is None or comm.group_size(cp_group) == 1:
        return
    group = state(cp_group)  # kept as is, folded at the exchange (no op per call), bounded
    group.flagged = group.flagged if len(group.flagged) < ROWS_KEPT else [(0, _flags(group))]
    group.flagged.append((list(FLAGS).index(name), wrong))


def _flags(group: GroupAgreement) -> Optional[torch.Tensor]:  # bit i: FLAGS[i], unread
    bits = [wrong.to(torch.int64) << bit for bit, wrong in group.flagged]
    return functools.reduce(torch.bitwise_or, bits) if bits else None


def _record(group: GroupAgreement, values: Dict[str, int]) -> None:
    row = row_of(values)
    group.digest = (group.digest * 1000003 + hash(row)) % _MIX
    group.call_code = (hash(row) * _MIX_CALL + group.later) % _MIX  # in band: this call
    group.call_grads = values.get("requires_grad", 0) > 0
    if len(group.rows) < ROWS_KEPT:
        group.rows.append(row)


def note_weight(weight) -> None:
    """Note the leaves ``weight`` is made of (itself, or a LoRA sum's parameters)."""
    nodes, seen = [getattr(weight, "grad_fn", None)], 0
    if nodes[0] is None and isinstance(weight, torch.Tensor) and weight.requires_grad:
        if _WEIGHTS.get(id(weight)) is not weight:  # a set makes a weak reference each time
            _WEIGHTS[id(weight)] = weight
    while nodes and seen < 64:  # a few nodes: a cast, a LoRA product and sum
        node, seen = nodes.pop(), seen + 1
        leaf = getattr(node, "variable", None)
        if leaf is not None:
            _WEIGHTS[id(leaf)] = leaf
        nodes.extend(n for n, _ in getattr(node, "next_functions", ()) if n is not None)


def _settle_for(optimizer, *_) -> None:
    """A torch optimizer about to step a weight of LAGA calls settles first."""
    if any(_WEIGHTS.get(id(p)) is p for group in optimizer.param_groups
           for p in group["params"]):
        settle()


def _install_optimizer_hook(hooked=[]) -> None:  # noqa: B006 -- once per process
    if not hooked:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        hooked.append(register_optimizer_step_pre_hook(_settle_for))

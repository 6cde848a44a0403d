"""Collectives over the context-parallel group, with exact autograd and a byte counter.

Only the tensor collectives that HCCL and NCCL implement (and gloo runs on CPU)
are used: ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and
``all_to_all_single``, always with equal per-rank sizes.

Every collective is reported to the open :class:`CommCounter` objects with two
exact sizes, both read off the tensors handed to the collective:

- ``payload``: this rank's sequence-sharded tensor (the all-gather input, the
  reduce-scatter output, the all-to-all input). ``payload * (P-1)/P`` is the
  convention of the paper (docs/DESIGN.md, sections 'Communication' and 'Byte counter').
- ``wire``: the bytes this rank sends to other ranks under the standard
  algorithms (ring all-gather / reduce-scatter: ``(P-1) * shard``; all-to-all:
  ``(P-1)/P`` of the input). This is what a link actually carries.

Each record also names the group it ran over (``group``): "cp" (the whole CP
group), "ulysses" (hybrid CP's group of U ranks, inside a node) or "ring"
(hybrid CP's R ranks with the same Ulysses rank, across nodes), so intra-node
and cross-node traffic are counted apart.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

DATA_KINDS = ("all_gather", "reduce_scatter", "all_to_all")
GROUPS = ("cp", "ulysses", "ring")
DIRECTIONS = ("forward", "backward")


@dataclass
class CommRecord:
    kind: str
    direction: str  # "forward" or "backward"
    payload: int
    wire: int
    group_size: int
    tag: str = ""
    seconds: float = 0.0  # time the caller was blocked: the call, or the wait of an async op
    group: str = "cp"     # which group it ran over (GROUPS)
    side: int = 0         # bytes per rank sent beside the payload (agreement/inband.py)


@dataclass
class CommCounter:
    """Exact per-collective byte counts; open it with :func:`count_bytes`."""

    records: List[CommRecord] = field(default_factory=list)

    def bytes(self, kind: Optional[str] = None, direction: Optional[str] = None,
              measure: str = "payload", group: Optional[str] = None) -> int:
        """Total bytes of ``measure`` ("payload" or "wire") over matching records.

        ``kind=None`` sums the data collectives only (not the small rank
        handshake, kind "handshake"); ``group`` keeps one group's records
        ("cp", "ulysses" or "ring"; None: all).
        """
        _check_choice("kind", kind, DATA_KINDS + ("handshake",))
        _check_choice("direction", direction, DIRECTIONS)
        if measure not in ("payload", "wire"):
            raise ValueError(f"measure must be 'payload' or 'wire', got {measure!r}")
        if group is not None and group not in GROUPS:
            raise ValueError(f"group must be one of {GROUPS} or None, got {group!r}")
        kinds = DATA_KINDS if kind is None else (kind,)
        return sum(getattr(r, measure) for r in self.records
                   if r.kind in kinds and (direction is None or r.direction == direction)
                   and (group is None or r.group == group))

    def design_bytes(self, direction: Optional[str] = None) -> float:
        """payload * (P-1)/P, summed: the paper's convention (docs/DESIGN.md, section 'Byte counter')."""
        _check_choice("direction", direction, DIRECTIONS)
        return sum(r.payload * (r.group_size - 1) / r.group_size for r in self.records
                   if r.kind in DATA_KINDS and (direction is None or r.direction == direction))

    def summary(self) -> Dict[str, Dict[str, Dict[str, int]]]:
        """{direction: {kind: {"payload": bytes, "wire": bytes, "calls": n}}}."""
        out: Dict[str, Dict[str, Dict[str, int]]] = defaultdict(
            lambda: defaultdict(lambda: {"payload": 0, "wire": 0, "calls": 0}))
        for r in self.records:
            slot = out[r.direction][r.kind]
            slot["payload"] += r.payload
            slot["wire"] += r.wire
            slot["calls"] += 1
        return {d: dict(k) for d, k in out.items()}


def _check_choice(name: str, value, choices) -> None:
    """A filter that matches no record would read as 0 bytes: a typo must raise instead."""
    if value is not None and value not in choices:
        raise ValueError(f"{name} must be one of {choices} or None, got {value!r}")


_OPEN_COUNTERS: List[CommCounter] = []


@contextlib.contextmanager
def count_bytes():
    """``with count_bytes() as c: ...`` records every collective issued inside."""
    counter = CommCounter()
    _OPEN_COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _OPEN_COUNTERS.remove(counter)


def _record(kind: str, direction: str, payload: int, wire: int, size: int, tag: str = "",
            label: str = "cp"):
    """Log a collective in every open counter; returns the records to time."""
    records = [CommRecord(kind, direction, payload, wire, size, tag, group=label)
               for _ in _OPEN_COUNTERS]
    for counter, record in zip(_OPEN_COUNTERS, records):
        counter.records.append(record)
    return records


class Pending:
    """An async collective's handle; ``wait()`` adds the blocked time to its records."""

    def __init__(self, work, records, group=None):
        self.work, self.records, self.group = work, records, group

    def wait(self):
        start = time.perf_counter()
        try:
            self.work.wait()
        except RuntimeError as exc:
            raise _named(exc, self.group) from exc
        for record in self.records:
            record.seconds += time.perf_counter() - start


def _named(exc: RuntimeError, group) -> BaseException:
    """A failed collective names its cause: a peer's error from the store (a call that
    exchanged nothing, below), else what makes a rank miss a collective. (A plain
    ``except`` at each call: a context manager per collective costs more host time.)"""
    cause = peer_failure(group)
    if cause is not None:
        return cause
    return RuntimeError(
        f"a LAGA collective on cp_group failed ({exc}); a CP rank did not join it: it "
        "skipped or repeated a LAGA layer, ran no backward through a call its peers ran "
        "backward through (its inputs needed no grad, or it ran forward only), stopped, or "
        "is still in another collective; every rank of cp_group must make the same LAGA "
        "calls in the same order")


def _run(collective, records, async_op: bool, group=None):
    """Issue a collective; sync calls are timed, async ones return a :class:`Pending`."""
    start = time.perf_counter()
    try:
        work = collective(async_op)
    except RuntimeError as exc:
        raise _named(exc, group) from exc
    if async_op:
        return Pending(work, records, group)
    for record in records:
        record.seconds += time.perf_counter() - start
    return None


# torch 2.7.1's gloo group joins its worker threads in its destructor while the caller
# holds the GIL. A worker that drops the last reference to a tensor whose Python object
# already died needs the GIL to free it, so dropping a group right after a collective
# on a temporary deadlocks both. Python keeps each group's latest CPU collective's
# tensors until its next one, or until the group is gone (its weak key dies after the
# destructor has run).
_LAST_TENSORS: "weakref.WeakKeyDictionary[object, tuple]" = weakref.WeakKeyDictionary()


def _hold(group, *tensors: torch.Tensor) -> None:
    if type(group) is dist.ProcessGroup and tensors[0].is_cpu:  # (weakly referable)
        _LAST_TENSORS[group] = tensors


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def check_group(group, name: str = "cp_group") -> int:
    """The size of ``group`` (None: 1), after checking it is a process group holding this
    rank; ValueError naming ``name`` otherwise. Runs no collective, so a rank can raise
    it alone."""
    if group is None:
        return 1
    if type(group) is dist.ProcessGroup and group in _MEMBER_OF and dist.is_initialized():
        return group.size()  # checked before: membership does not change
    if group is getattr(dist.GroupMember, "NON_GROUP_MEMBER", object()):
        raise ValueError(f"{name}: this process (global rank {dist.get_rank()}) is not a member "
                         "of it (dist.new_group returns GroupMember.NON_GROUP_MEMBER to the ranks "
                         "outside the group); pass the group this rank belongs to")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"{name} must be a torch.distributed process group (e.g. "
                         f"dist.group.WORLD or dist.new_group(ranks)) or None, got "
                         f"{type(group).__name__} {group!r}"[:300])
    if not dist.is_initialized():
        raise ValueError(f"{name} is given but torch.distributed is not initialized; call "
                         "dist.init_process_group first (or pass None: no CP)")
    if dist.get_rank(group) < 0:
        raise ValueError(f"{name}: this process (global rank {dist.get_rank()}) is not a member "
                         f"of it (global ranks {dist.get_process_group_ranks(group)}); pass the "
                         "group this rank belongs to (new_group returns a group on every rank, "
                         "usable only by its members)")
    if type(group) is dist.ProcessGroup:
        _MEMBER_OF[group] = True
    return dist.get_world_size(group)


_MEMBER_OF: "weakref.WeakKeyDictionary[object, bool]" = weakref.WeakKeyDictionary()


def group_size(group) -> int:
    if type(group) is dist.ProcessGroup:  # what get_world_size returns for it, per call cheaper
        return group.size()
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    if type(group) is dist.ProcessGroup and group in _MEMBER_OF:  # its rank in it, cheaper
        return group.rank()
    return 0 if group is None else dist.get_rank(group)


# torch >= 2.13 renames the tensor collectives; 2.7.1 (the Ascend stack) has only
# the old names. Prefer the new ones when present so no deprecation warning fires.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---------------------------------------------------------------- raw collectives

def all_gather_raw(x: torch.Tensor, group, direction: str, tag: str = "", async_op: bool = False,
                   label: str = "cp", side: int = 0):
    """Concatenate every rank's ``x`` along dim 0, in rank order (``label``: GROUPS);
    ``side``: bytes at the end of ``x`` that are not payload (counted apart)."""
    size = group_size(group)
    x = x.contiguous()
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    payload = _nbytes(x) - side
    records = _record("all_gather", direction, payload, (size - 1) * payload, size, tag, label)
    for record in records:
        record.side = side
    pending = _run(lambda a: _all_gather_tensor(out, x, group=group, async_op=a), records, async_op,
                   group)
    _hold(group, x, out)
    return (out, pending) if async_op else out


def reduce_scatter_raw(x: torch.Tensor, group, direction: str, tag: str = "", async_op: bool = False,
                       label: str = "cp"):
    """Sum ``x`` over ranks and keep this rank's dim-0 shard."""
    size = group_size(group)
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    records = _record("reduce_scatter", direction, _nbytes(out), (size - 1) * _nbytes(out), size, tag,
                      label)
    pending = _run(lambda a: _reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM, group=group,
                                                    async_op=a), records, async_op, group)
    _hold(group, x, out)
    return (out, pending) if async_op else out


def all_to_all_raw(x: torch.Tensor, group, direction: str, tag: str = "",
                   label: str = "cp") -> torch.Tensor:
    """Dim 0 of ``x`` is split in P equal parts; part j goes to rank j."""
    size = group_size(group)
    x = x.contiguous()
    out = torch.empty_like(x)
    records = _record("all_to_all", direction, _nbytes(x), _nbytes(x) * (size - 1) // size, size, tag,
                      label)
    _run(lambda a: dist.all_to_all_single(out, x, group=group, async_op=a), records, False, group)
    _hold(group, x, out)
    return out


def handshake(values: List[int], group, device, slot=None) -> List[List[int]]:
    """Every rank's few integers (argument checks before data moves); ``slot``: (index, 0-d
    int64 device tensor) written into the row on the device, unread before. An all-reduce
    of the table, not an all-gather: a rank that meets a peer's latent gather here (a skipped
    layer) times out with a named error, where gloo aborts on all-gathers of unequal sizes."""
    size, rank = group_size(group), group_rank(group)
    table = torch.zeros(size, len(values), dtype=torch.int64, device=device)
    mine = table[rank]
    mine.copy_(torch.tensor(values, dtype=torch.int64))
    if slot is not None:
        mine[slot[0]] = slot[1].to(device)
    # a ring all-reduce sends 2 (P - 1) / P of the table: 2 (P - 1) rows
    _record("handshake", "forward", _nbytes(mine), 2 * (size - 1) * _nbytes(mine), size)
    try:
        dist.all_reduce(table, group=group)
    except RuntimeError as exc:
        raise _named(exc, group) from exc
    _hold(group, table)
    return table.tolist()


# ---------------------------------------------------------------- autograd wrappers

def _copy_raw(x: torch.Tensor, group, direction: str, tag: str = "", label: str = ""):
    """Identity: the tensor every rank of ``group`` already holds (see sum_grad)."""
    return x.view_as(x)


def _all_reduce_raw(x: torch.Tensor, group, direction: str, tag: str = "", label: str = ""):
    """Sum over ``group`` into a new tensor.

    Only tensor parallelism uses it (sum_grad): the reduction Megatron's own
    column-parallel layer makes of the same gradient, not CP traffic, so the byte counter
    does not record it. Into a new tensor because megatron's
    copy_to_tensor_model_parallel_region reduces ``grad.contiguous()`` in place and
    returns ``grad``, dropping the sum when the incoming gradient is not contiguous.
    """
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    _hold(group, out)
    return out


# Each collective's backward is its adjoint collective, run again through _Collective, so a
# double backward (create_graph=True) differentiates through it and reaches the peers' grads.
_FORWARD = {"all_gather": all_gather_raw, "reduce_scatter": reduce_scatter_raw,
            "all_to_all": all_to_all_raw, "copy": _copy_raw, "all_reduce": _all_reduce_raw}
_ADJOINT = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather",
            "all_to_all": "all_to_all", "copy": "all_reduce", "all_reduce": "all_reduce"}


class _Collective(torch.autograd.Function):
    """One collective (``kind``) forward; its adjoint on the gradient backward."""

    @staticmethod
    def forward(ctx, x, kind, group, tag, label, direction="forward"):
        ctx.kind, ctx.group, ctx.tag, ctx.label = kind, group, tag, label
        return _FORWARD[kind](x, group, direction, tag, label=label)

    @staticmethod
    def backward(ctx, grad):
        adjoint = _Collective.apply(grad, _ADJOINT[ctx.kind], ctx.group, ctx.tag, ctx.label,
                                    "backward")
        return adjoint, None, None, None, None, None


def gather_seq(x: torch.Tensor, group, tag: str = "", label: str = "cp") -> torch.Tensor:
    """[s, ...] on each rank -> [P*s, ...] in rank order; grads reduce-scattered."""
    if group_size(group) == 1:
        return x
    return _Collective.apply(x, "all_gather", group, tag, label)


def seq_to_heads(x: torch.Tensor, group, tag: str = "", label: str = "cp") -> torch.Tensor:
    """Ulysses: [s, b, n, d] sequence-split -> [P*s, b, n/P, d] head-split (rank order)."""
    size = group_size(group)
    if size == 1:
        return x
    s, b, n, d = x.shape
    # dim 0 of the send buffer must be the destination rank: its head group.
    send = x.reshape(s, b, size, n // size, d).permute(2, 0, 1, 3, 4)
    # [P(source rank), s, b, n/P, d]
    recv = _Collective.apply(send, "all_to_all", group, tag, label)
    return recv.reshape(size * s, b, n // size, d)


def heads_to_seq(x: torch.Tensor, group, tag: str = "", label: str = "cp") -> torch.Tensor:
    """Ulysses: [P*s, b, n/P, d] head-split (rank order) -> [s, b, n, d] sequence-split."""
    size = group_size(group)
    if size == 1:
        return x
    total, b, h, d = x.shape
    s = total // size
    send = x.reshape(size, s, b, h, d)  # dim 0: the rank that owns those tokens
    # [P(source rank = head group), s, b, h, d]
    recv = _Collective.apply(send, "all_to_all", group, tag, label)
    return recv.permute(1, 2, 0, 3, 4).reshape(s, b, size * h, d)


def sum_grad(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; the gradient summed over ``group`` backward.

    Tensor parallelism: a tensor every TP rank holds whole (the latent, LoRA's A) that
    meets only this rank's rows of a weight gets a partial gradient per rank; the sum is
    its gradient, as Megatron's copy_to_tensor_model_parallel_region makes it.
    """
    if group_size(group) == 1:
        return x
    return _Collective.apply(x, "copy", group, "", "tp")


# ---------------------------------------------------------------- hybrid CP groups

# Built once per (cp_group, kind, ...) and cached: new_group is collective over its members.
# Weakly keyed by the CP group: the subgroups go with it, none outlives it.
_GROUPS: "weakref.WeakKeyDictionary[object, Dict[tuple, object]]" = weakref.WeakKeyDictionary()


def _subgroup(cp_group, key: tuple, ranks: List[int]):
    """A group of ``ranks`` (global ranks), made with ``use_local_synchronization=True`` so
    only its members take part: no rank outside it, and no sibling group, has to call in
    the same order."""
    built = _GROUPS.setdefault(cp_group, {})
    if key not in built:
        built[key] = dist.new_group(ranks, use_local_synchronization=True)
    return built[key]


def ulysses_group(cp_group, ulysses_degree: int):
    """This rank's Ulysses group of hybrid CP: the U = ``ulysses_degree`` consecutive ranks
    of ``cp_group`` holding it (CP rank c = r*U + u). Collective over those U ranks."""
    cp_ranks = dist.get_process_group_ranks(cp_group)
    first = group_rank(cp_group) // ulysses_degree * ulysses_degree
    return _subgroup(cp_group, ("ulysses", ulysses_degree), cp_ranks[first:first + ulysses_degree])


def hybrid_ring_group(cp_group, ulysses_group):
    """The ring group of hybrid CP: the R = P/U ranks of ``cp_group`` with this
    rank's Ulysses rank (CP ranks u, U+u, 2U+u, ...), in ring-rank order.

    Collective over those R ranks: each builds it on its first call for a
    (cp_group, ulysses_group) pair. The explicit form calls it right after the
    handshake, which every rank of cp_group passes together, so the members
    always meet.
    """
    degree = group_size(ulysses_group)
    u = group_rank(cp_group) % degree
    ranks = dist.get_process_group_ranks(cp_group)[u::degree]
    return _subgroup(cp_group, ("ring", ulysses_group), ranks)


# ---------------------------------------------------------------- a failure told through the store
# A local failure in a call that exchanges nothing (agreement/schedule.py) is left in the
# process group's store: a peer whose data collective then fails (gloo: when the failing
# process has left; NCCL/HCCL: at the timeout) raises it, naming the rank. Such calls are
# counted alike on every rank (per group, weakly keyed), so a message is read only for its
# own call.

_SKIPPED: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
WHY = {"skip": "every rank had passed check_ranks=False",
       "fold": "a later call of a micro-batch, agreed at the next exchange or settle"}


def _store_key(group, call: int) -> str:
    ranks = "-".join(map(str, dist.get_process_group_ranks(group)))
    return f"mindspeed_laga/skipped_call_failure/{ranks}/{call}"


def count_skipped(group) -> None:
    """One more call of ``group`` exchanged nothing (every rank counts it)."""
    _SKIPPED[group] = _SKIPPED.get(group, 0) + 1


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
        key = _store_key(group, _SKIPPED.get(group, 0))
        store.set(key, f"{dist.get_rank(group)}\n{mode}\n{text}")
    except Exception:  # noqa: BLE001 -- telling is best effort: the failure itself must raise
        pass
    return failure


def peer_failure(group) -> Optional[ValueError]:
    """The error a peer left for this rank's current such call of ``group``, or None."""
    try:
        if group is None or group not in _SKIPPED:
            return None
        key = _store_key(group, _SKIPPED[group])
        store = dist.distributed_c10d._get_default_store()
        if not store.check([key]):
            return None
        rank, mode, text = store.get(key).decode(errors="replace").split("\n", 2)
    except Exception:  # noqa: BLE001 -- no message to read: the backend's error stands
        return None
    return ValueError(f"CP rank(s) [{rank}] rejected their arguments in a call that exchanged "
                      f"nothing before its data collective ({WHY.get(mode, mode)}), so this rank "
                      f"learnt of it when that collective failed: CP rank {rank}: {text}")

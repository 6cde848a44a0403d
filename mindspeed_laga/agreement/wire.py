"""The exchange: one row of int64 per rank (fields.py), the same length for every call (so
ranks in different calls meet and are told so), and the same error raised on every rank
when a rank rejected its call (its message in one more small exchange) or a value differs.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch

from .. import comm
from .fields import DIGESTS, FIELDS, FLAGS, UNKNOWN, label, show

Names = Optional[Dict[str, Sequence[str]]]
_MESSAGE_BYTES = 1500
LATER = ("(a later call of the micro-batch, which exchanges nothing: found at the next "
         "exchange or settle)")
SAME = "every rank of cp_group must pass the same value"


def exchange(values: Dict[str, int], failure, cp_group, device, names: Names = None,
             details: Optional[Dict[str, object]] = None,
             later: Optional[Callable[[], List[int]]] = None, content=None,
             flags=None) -> List[List[int]]:
    """Exchange ``values`` and the verdict; raise alike on every rank, else the table (a row
    per rank). Gathered only where ranks differ: ``details`` (a field's full value) and
    ``later()`` (the later rows); ``content``, ``flags``: 0-d device tensors, unread."""
    row, failure = _pack(values, failure)
    device = exchange_device(device, cp_group)
    slot = None
    if content is not None or flags is not None:
        at, unknown = FIELDS.index("content"), torch.tensor(UNKNOWN, device=device)
        both = [unknown if t is None else t.to(device) for t in (content, flags)]
        slot = (slice(at, at + 2), torch.stack(both))
    table = comm.handshake(row, cp_group, device, slot=slot)
    raise_on_rejection(table, failure, cp_group, device)
    _raise_on_flags(table, last=False)
    _raise_on_difference(table, names, details or {}, cp_group, device)
    _raise_on_later(table, names, later, cp_group, device)
    _raise_on_flags(table, last=True)  # in band: after the rows had their chance to name it
    return table


def _pack(values: Dict[str, int], failure):
    """(this rank's row, its failure): a value beyond int64 travels as unknown and becomes
    this rank's failure, which reaches the peers like any other."""
    row = [UNKNOWN] * len(FIELDS)
    for key, value in values.items():
        if -(1 << 63) <= int(value) < 1 << 63:
            row[FIELDS.index(key)] = int(value)
        elif failure is None:
            failure = ValueError(f"{key}={int(value)} is beyond the int64 range the ranks "
                                 "exchange; pass a value below 2**63")
    row[0] = int(failure is not None)
    return row, failure


def exchange_device(device, cp_group):
    """The call's device, unless it has no storage (meta), then the backend's."""
    device = torch.device(device)
    if device.type != "meta":
        return device
    kind = {"nccl": "cuda", "hccl": "npu"}.get(str(torch.distributed.get_backend(cp_group)))
    if kind is None:
        return torch.device("cpu")
    return torch.device(kind, getattr(torch, kind).current_device())


def as_exception(failure) -> BaseException:
    return failure if isinstance(failure, BaseException) else ValueError(failure)


def raise_failure(failure) -> None:
    if failure is not None:
        raise as_exception(failure)


def raise_on_rejection(table, failure, cp_group, device) -> None:
    """Every rank learns every rejecting rank's message; the rejecting ranks re-raise their
    own exception and the others a ValueError carrying those messages."""
    rejected = [r for r, row in enumerate(table) if row[0]]
    if not rejected:
        return
    mine = b""
    if failure is not None:
        text = str(failure) if isinstance(failure, (ValueError, str)) else \
            f"{type(failure).__name__}: {failure}"
        mine = text.encode()[:_MESSAGE_BYTES]
    texts = gather_detail(list(mine), cp_group, device, shorten=False)
    raise_failure(failure)
    causes = "; ".join(f"CP rank {r}: {bytes(texts[r] or []).decode(errors='replace')}"
                       for r in rejected)
    raise ValueError(f"CP rank(s) {rejected} rejected their arguments (no collective was "
                     f"issued): {causes}")


def _raise_on_difference(table, names: Names, details, cp_group, device) -> None:
    stage = FIELDS.index("stage")
    by_rank = [show("stage", row[stage]) for row in table]
    if len(set(by_rank)) > 1 and set(by_rank) <= {"attention", "start_latent_gather"}:
        raise ValueError(f"CP ranks disagree on latent_gather: the ranks' calls are {by_rank}; "
                         "every rank must start the overlapped gather (start_latent_gather + "
                         "latent_gather=) or none")
    if len(set(by_rank)) > 1:
        raise ValueError(f"CP ranks are in different calls: {by_rank} (by rank); every rank of "
                         "cp_group must make the same LAGA calls in the same order (the same "
                         "modules, the same micro-batches, settle on every rank alike)")
    for i, name in _differing(table, start=2):
        if name in details:  # every rank sees the same table, so all gather together
            detail = details[name]
            shown = gather_detail(detail() if callable(detail) else detail, cp_group, device)
        else:
            shown = [show(name, row[i], names) for row in table]
        raise ValueError(f"CP ranks disagree on {label(name)}: {shown} (by rank); {SAME}")


def _differing(rows, start: int = 1):
    """(index, name) of the fields (digests aside) on which ``rows`` differ."""
    return [(i, name) for i, name in enumerate(FIELDS) if i >= start and name not in DIGESTS
            and len({row[i] for row in rows}) > 1]


def _raise_on_later(table, names: Names, later, cp_group, device) -> None:
    """The later calls' digests differ: gather each rank's recorded rows (this path only)
    and name the first field that differs in the first call that differs."""
    calls, content, width = FIELDS.index("calls"), FIELDS.index("content"), len(FIELDS)
    if len({row[calls] for row in table}) > 1:
        flat = gather_detail(later() if later is not None else [], cp_group, device,
                             shorten=False)
        rows = [[tuple(f[i:i + width]) for i in range(0, len(f or []), width)] for f in flat]
        for k in range(max(len(r) for r in rows)):
            if any(k >= len(r) for r in rows):
                raise ValueError(f"CP ranks made different numbers of LAGA calls in a "
                                 f"micro-batch: {[len(r) for r in rows]} later calls (by rank) "
                                 f"{LATER}; every rank of cp_group must run the same modules "
                                 "in the same order")
            for i, name in _differing([r[k] for r in rows])[:1]:
                shown = [show(name, r[k][i], names) for r in rows]
                raise ValueError(f"CP ranks disagree on {label(name)} in a later call (call "
                                 f"{k + 2} of the micro-batch): {shown} (by rank) {LATER}; {SAME}")
        raise ValueError(f"CP ranks disagree on their later calls beyond the ones recorded "
                         f"{LATER}; every rank of cp_group must pass the same values")
    if len({row[content] for row in table}) > 1:
        raise ValueError(f"CP ranks disagree on {label('key_padding')} in a later call: its "
                         f"contents differ (compared on the device) {LATER}; {SAME}")


def _raise_on_flags(table, last: bool) -> None:
    """Inputs a rank found wrong on the device since the last exchange (``last``: the
    in-band flag alone, else the others)."""
    bits = [max(row[FIELDS.index("flags")], 0) for row in table]
    for i, (name, what) in enumerate(FLAGS.items()):
        ranks = [r for r, b in enumerate(bits) if b >> i & 1]
        if ranks and last == (name == "latent"):
            raise ValueError(
                f"CP ranks' later calls differ: the {name} {what}; those calls returned NaN on "
                "every rank (read at this exchange or settle); every rank of cp_group must make "
                "the same LAGA calls (layers, weights, kv_up_linear scales, shapes) in the same "
                "order" if last else f"CP rank(s) {ranks}: {name} {what}, in a call since the "
                "last exchange (found on the device, read at this exchange or settle; the rows "
                f"that read them returned NaN); pass valid {name} on every rank")


def gather_detail(mine: Sequence[int], cp_group, device, shorten: bool = True) -> List[object]:
    """Every rank's full value (a list of ints of any length): two small exchanges."""
    lengths = [row[0] for row in comm.handshake([len(mine)], cp_group, device)]
    padded = list(mine) + [UNKNOWN] * (max(lengths) - len(mine))
    table = comm.handshake(padded or [UNKNOWN], cp_group, device)
    return [(_shorten(row[:n]) if shorten else row[:n]) if n else None
            for row, n in zip(table, lengths)]


def _shorten(values: List[int], keep: int = 12):
    return values if len(values) <= keep else values[:keep // 2] + ["..."] + values[-keep // 2:]

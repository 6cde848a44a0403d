"""The cross-rank handshake: every CP rank agrees on a call before data moves.

A data collective whose ranks disagree does not fail cleanly: an all-gather
meeting an all-to-all hangs until the process-group timeout, mismatched sizes
abort inside gloo, and a different layout, ``causal`` or ``softmax_scale``
runs and returns wrong numbers. So before its first data collective each
call all-gathers one fixed-length row of integers per rank (the verdict of
its local checks and every value that must agree, see :data:`FIELDS`) and
every rank raises the same ``ValueError``, naming the argument and the values
by rank, when any rank rejected its arguments or any value differs.

The row has the same length for every call that can handshake (the
attention forms and ``start_latent_gather``), so a rank that overlaps the
latent gather and one that does not meet in the same collective and the
difference is reported, not hung on.

``check_ranks`` and the group's policy (see docs/DESIGN.md, section
"Handshake"): the first call on a CP group always exchanges, whatever
``check_ranks`` says, and the exchanged row carries ``check_ranks`` itself.
Once every rank has passed ``check_ranks=False`` in an exchange, the group's
later calls skip it (one small collective saved per call); until then every
call exchanges. The policy changes only through an exchange, whose result
every rank sees alike, so ranks never go out of step over it.
:func:`reset` (on every rank) turns the exchange back on.
"""
from __future__ import annotations

import struct
from typing import Dict, List, Optional, Sequence

from . import comm

# Every value a rank puts in its row, in order. -1 = not known at this stage.
FIELDS = ("rejected", "stage", "check_ranks", "form", "cp_algo", "layout", "causal",
          "softmax_scale", "local_len", "micro_batch", "heads", "qk_head_dim", "rope_dim",
          "v_head_dim", "kv_lora_rank", "dtype", "requires_grad", "recompute_kv",
          "kv_block_size", "trim_causal_prefix", "latent_gather", "documents", "ulysses_degree")
STAGES = ("attention", "start_latent_gather")
# How a difference is named in the message (arguments by their keyword).
LABELS = {"local_len": "the local sequence length", "micro_batch": "the micro-batch",
          "heads": "the heads", "rope_dim": "the qk_pos_emb_head_dim",
          "qk_head_dim": "the qk_head_dim", "v_head_dim": "the v_head_dim",
          "kv_lora_rank": "the kv_lora_rank", "dtype": "the dtype",
          "requires_grad": "whether grads are needed (requires_grad under grad mode)",
          "ulysses_degree": "the size of ulysses_group"}
UNKNOWN = -1

_SKIP = {}  # cp_group -> True once every rank agreed on check_ranks=False


def float_bits(x: float) -> int:
    """The exact bits of a float64 as a signed int64 (so 0.1 and 0.1+1ulp differ)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def bits_float(n: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(n)))[0]


def reset(cp_group=None) -> None:
    """Exchange again on every call of ``cp_group`` (all groups when None); call on every rank."""
    if cp_group is None:
        _SKIP.clear()
    else:
        _SKIP.pop(cp_group, None)


def skips(cp_group) -> bool:
    """Whether this group's calls skip the exchange (every rank chose check_ranks=False)."""
    return _SKIP.get(cp_group, False)


def agree(values: Dict[str, int], error: Optional[str], cp_group, device,
          names: Optional[Dict[str, Sequence[str]]] = None) -> None:
    """Exchange ``values`` (keys from FIELDS) and this rank's verdict; raise alike on every rank.

    ``names`` maps a field to the names of its codes, for the message.
    """
    if comm.group_size(cp_group) == 1 or skips(cp_group):
        if error is not None:
            raise ValueError(error)
        return
    row = [UNKNOWN] * len(FIELDS)
    for key, value in values.items():
        row[FIELDS.index(key)] = int(value)
    row[0] = 0 if error is None else 1
    table = comm.handshake(row, cp_group, device)
    if error is not None:
        raise ValueError(error)
    _raise_on_difference(table, names or {})
    if all(r[FIELDS.index("check_ranks")] == 0 for r in table):
        _SKIP[cp_group] = True


def _raise_on_difference(table: List[List[int]], names: Dict[str, Sequence[str]]) -> None:
    rejected = [r for r, row in enumerate(table) if row[0]]
    if rejected:
        raise ValueError(f"CP rank(s) {rejected} rejected their arguments (see the error there); "
                         "no collective was issued")
    stage = FIELDS.index("stage")
    if len({row[stage] for row in table}) > 1:
        by_rank = [STAGES[row[stage]] for row in table]
        raise ValueError(
            f"CP ranks disagree on latent_gather: the ranks' calls are {by_rank}; every rank "
            "must start the overlapped gather (start_latent_gather + latent_gather=) or none")
    for i, field in enumerate(FIELDS[2:], start=2):
        values = [row[i] for row in table]
        if len(set(values)) > 1:
            shown = [_show(field, v, names) for v in values]
            raise ValueError(f"CP ranks disagree on {LABELS.get(field, field)}: {shown} (by "
                             "rank); every rank of cp_group must pass the same value")


def _show(field: str, value: int, names: Dict[str, Sequence[str]]):
    if value == UNKNOWN:
        return "unknown"
    if field == "softmax_scale":
        return bits_float(value)
    if field in names and 0 <= value < len(names[field]):
        return names[field][value]
    if field in ("causal", "check_ranks", "requires_grad", "recompute_kv", "trim_causal_prefix",
                 "latent_gather"):
        return bool(value)
    return value


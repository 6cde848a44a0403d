"""The cross-rank handshake: every CP rank agrees on a call before data moves.

A data collective whose ranks disagree does not fail cleanly: an all-gather
meeting an all-to-all hangs until the process-group timeout, mismatched sizes
abort inside gloo, and a different layout, ``causal`` or ``softmax_scale``
runs and returns wrong numbers. So before its first data collective each
call all-gathers one fixed-length row of integers per rank (the verdict of
its local checks and every value that must agree, see :data:`FIELDS`) and
every rank raises the same ``ValueError``, naming the argument and the values
by rank, when any rank rejected its arguments or any value differs. A rank
that rejected re-raises its own exception and its peers raise with its
message (one more small exchange, on that path only); a value that cannot
travel as an int64 is that rank's rejection, never an error before the
exchange, and meta tensors exchange on the backend's device.

The row has the same length for every call that can handshake (the
attention forms, sparse MLA, ``start_latent_gather`` and ``agreement.settle``),
so a rank that overlaps the latent gather and one that does not meet in the same
collective and the difference is reported, not hung on.

*Which* calls exchange is ``agreement.py``'s decision: once per micro-batch for a
group that opens micro-batches (the adapters do), every call otherwise. In the
latter, per-call mode (see docs/DESIGN.md, section
"Handshake"): the first call on a CP group always exchanges, whatever
``check_ranks`` says, and the exchanged row carries ``check_ranks`` itself. Once every rank has
passed ``check_ranks=False`` in an exchange, the group's later calls skip it
(one small collective saved per call) unless a call passes ``check_ranks=True``
explicitly, which exchanges again (every rank must pass it in that call, as
the adapters do on a module's first call); until then every call exchanges.
The policy changes only through an exchange, whose result every rank sees
alike, so ranks never go out of step over it. :func:`reset` (on every rank)
turns the exchange back on.

:func:`check_same_weight` is a separate one-integer exchange: a checksum of a
weight every CP rank must hold alike (``kv_up_weight``); the adapters run it
on a module's first call.
"""
from __future__ import annotations

import struct
from typing import Dict, List, Optional, Sequence

import torch

from . import comm, skipped

# Every value a rank puts in its row, in order. -1 = not known at this stage.
FIELDS = ("rejected", "stage", "check_ranks", "form", "cp_algo", "layout", "causal",
          "softmax_scale", "local_len", "micro_batch", "heads", "qk_head_dim", "rope_dim",
          "v_head_dim", "kv_lora_rank", "dtype", "requires_grad", "recompute_kv",
          "kv_block_size", "trim_causal_prefix", "latent_gather", "documents", "ulysses_degree", "key_padding",
          "empty_rows", "kv_up_linear",
          # sparse MLA (DSA); given_topk: the k of given picks (a layer reusing another's), 0: none
          "given_topk", "index_topk", "index_heads", "index_head_dim", "loss_target", "loss_coeff",
          "indexer_kernel", "attention_kernel", "loss_kernel",
          # the digests of the calls that exchanged nothing since the last exchange
          # (agreement.py): of their rows, and of the contents hashed on the device
          "calls", "content")
# What a row comes from: a dense form, the overlapped gather, sparse MLA, or agreement.settle.
STAGES = ("attention", "start_latent_gather", "sparse_attention", "settle")
# How a difference is named in the message (arguments by their keyword).
LABELS = {"local_len": "the local sequence length", "micro_batch": "the micro-batch",
          "heads": "the heads", "rope_dim": "the qk_pos_emb_head_dim",
          "qk_head_dim": "the qk_head_dim", "v_head_dim": "the v_head_dim",
          "kv_lora_rank": "the kv_lora_rank", "dtype": "the dtype",
          "requires_grad": "which inputs need grads (requires_grad under grad mode)",
          "ulysses_degree": "the size of ulysses_group", "documents": "documents (cu_seqlens)",
          "key_padding": "key_padding_mask (which keys are padding; shown: padding keys "
                         "per sample)",
          "kv_up_linear": "kv_up_linear (the up-projection: F.linear, or the FP8 recipe "
                          "and scales of the host's matmul)",
          "index_topk": "index_topk", "index_heads": "the index heads (index_query.shape[2])",
          "index_head_dim": "the index head dim (index_key.shape[-1])",
          "loss_target": "loss_target", "loss_coeff": "indexer_loss_coeff",
          "indexer_kernel": "indexer_kernel", "attention_kernel": "attention_kernel",
          "loss_kernel": "loss_kernel",
          "given_topk": "topk_indices (given picks: their k; 0: the indexer picks)"}
UNKNOWN = -1
CONTENT = -2  # a code left to the device-side content digest (agreement.content_code)
# The dtypes the forms run (float8 and the rest are refused by name), as handshake codes.
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# The inputs in requires-grad bit order (bit i: input i needs a gradient).
INPUTS = ("query", "kv_latent", "k_pos_emb", "kv_up_weight")

_SKIP = {}  # cp_group -> True once every rank agreed on check_ranks=False


def float_bits(x: float) -> int:
    """The exact bits of a float64 as a signed int64 (so 0.1 and 0.1+1ulp differ)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def bits_float(n: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(n)))[0]


def dtype_code(dtype) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else UNKNOWN


def grad_pattern(tensors: Dict[str, object]) -> int:
    """Which of ``tensors`` (keys from INPUTS) need a gradient, as bits (0 outside grad mode).

    Ranks must agree on the pattern, not only on "any": a rank whose latent needs
    no gradient skips the backward reduce-scatter its peers wait in."""
    if not torch.is_grad_enabled():
        return 0
    return sum(1 << INPUTS.index(name) for name, t in tensors.items()
               if isinstance(t, torch.Tensor) and t.requires_grad)


def _grad_names(bits: int) -> List[str]:
    return [name for i, name in enumerate(INPUTS) if bits >> i & 1]


def reset(cp_group=None) -> None:
    """Exchange again on every call of ``cp_group`` (all groups when None), in per-call mode
    until the group opens a micro-batch again; call on every rank."""
    from . import agreement  # agreement builds on this module
    agreement.reset(cp_group)
    if cp_group is None:
        _SKIP.clear()
    else:
        _SKIP.pop(cp_group, None)


def skips(cp_group) -> bool:
    """Whether this group's calls skip the exchange (every rank chose check_ranks=False)."""
    return _SKIP.get(cp_group, False)


def agree(values: Dict[str, int], failure, cp_group, device,
          names: Optional[Dict[str, Sequence[str]]] = None, *, force: bool = False,
          details: Optional[Dict[str, object]] = None, on_calls=None,
          content=None) -> None:
    """Exchange ``values`` (keys from FIELDS) and this rank's verdict; raise alike on every rank.

    ``failure``: this rank's local error (an exception, or its message), None
    when its checks passed; it is raised here, after the peers learnt of it.
    ``names`` maps a field to the names of its codes, for the message;
    ``force``: exchange even when the group skips (explicit ``check_ranks=True``);
    ``details``: per field, this rank's full value behind a code (the document
    boundaries behind their hash), a list or a function returning it, gathered only when
    ranks differ on it. ``on_calls()``: this rank's distinct folded rows, flattened
    (agreement.py), gathered only when the ranks' ``calls`` digests differ; ``content``:
    a 0-d int64 device tensor sent as the ``content`` field without a host read before
    the exchange (the digest of tensor contents seen in those calls).
    """
    if comm.group_size(cp_group) == 1:
        _raise(failure)
        return
    if skips(cp_group) and not force:  # no exchange: a failure reaches the peers by the store
        skipped.count(cp_group)
        if failure is not None:
            raise skipped.tell_peers(_as_exception(failure), cp_group)
        return
    row, failure = _pack(values, failure)
    device = exchange_device(device, cp_group)
    slot = (FIELDS.index("content"), content) if content is not None else None
    table = comm.handshake(row, cp_group, device, slot=slot)
    _raise_on_rejection(table, failure, cp_group, device)
    _raise_on_difference(table, names or {}, details or {}, cp_group, device)
    _raise_on_calls(table, names or {}, on_calls, cp_group, device)
    if all(r[FIELDS.index("check_ranks")] == 0 for r in table):
        _SKIP[cp_group] = True


_INT64 = (-(1 << 63), 1 << 63)


def _pack(values: Dict[str, int], failure):
    """(this rank's row, its failure): a value beyond int64 cannot travel, so it is sent as
    unknown and, unless a check already failed, becomes this rank's failure, which then
    reaches the peers like any other (a bare OverflowError here would leave them waiting)."""
    row = [UNKNOWN] * len(FIELDS)
    for key, value in values.items():
        value = int(value)
        if _INT64[0] <= value < _INT64[1]:
            row[FIELDS.index(key)] = value
        elif failure is None:
            failure = ValueError(f"{key}={value} is beyond the int64 range the ranks exchange; "
                                 f"pass a value below 2**63")
    row[0] = 0 if failure is None else 1
    return row, failure


def exchange_device(device, cp_group):
    """Where the exchange's tensors live: the call's device, unless it has no storage (meta
    tensors, refused by the checks), then the one the group's backend runs on."""
    device = torch.device(device)
    if device.type != "meta":
        return device
    backend = str(torch.distributed.get_backend(cp_group)).lower()
    kind = {"nccl": "cuda", "hccl": "npu"}.get(backend)
    if kind is None:
        return torch.device("cpu")
    return torch.device(kind, getattr(torch, kind).current_device())


def _raise_on_rejection(table: List[List[int]], failure, cp_group, device) -> None:
    """When any rank rejected its call: every rank learns every rejecting rank's message (one
    more small exchange, only on this path), the rejecting ranks re-raise their own exception
    and the others a ValueError carrying those messages, so every rank shows the cause."""
    rejected = [r for r, row in enumerate(table) if row[0]]
    if not rejected:
        return
    mine = _describe(failure).encode()[:_MESSAGE_BYTES] if failure is not None else b""
    texts = _gather_detail(list(mine), cp_group, device, shorten=False)
    _raise(failure)
    causes = "; ".join(f"CP rank {r}: {bytes(texts[r] or []).decode(errors='replace')}"
                       for r in rejected)
    raise ValueError(f"CP rank(s) {rejected} rejected their arguments (no collective was "
                     f"issued): {causes}")


_MESSAGE_BYTES = 1500


def _describe(failure) -> str:
    if isinstance(failure, ValueError) or not isinstance(failure, BaseException):
        return str(failure)
    return f"{type(failure).__name__}: {failure}"


def _raise(failure) -> None:
    if failure is None:
        return
    raise _as_exception(failure)


def _as_exception(failure) -> BaseException:
    return failure if isinstance(failure, BaseException) else ValueError(failure)


as_exception = _as_exception


def row_of(values: Dict[str, int]) -> tuple:
    """``values`` as a full row (UNKNOWN where absent), as a tuple: what a call folds."""
    return tuple(values.get(name, UNKNOWN) for name in FIELDS)


def check_same_weight(weight, cp_group, name: str = "kv_up_weight",
                      settings: Optional[Dict[str, Sequence[object]]] = None,
                      failure: Optional[BaseException] = None) -> None:
    """Raise on every rank unless every CP rank holds the same ``weight`` (bit for bit).

    One exchange of one int64 (a checksum of the weight's bits, computed where
    the weight lives). CP ranks are replicas of one TP shard: a rank with other
    values would run and return wrong numbers (wrong K/V for every peer).
    ``settings``: {name: (this rank's value, its choices)} sent in the same exchange
    (an adapter's configuration, before it builds any group); ranks that differ
    raise "CP ranks disagree on <name>" with the values by rank.
    ``failure``: this rank could not produce the weight (``weight`` None then, e.g. an
    adapter it cannot read): it re-raises it and its peers raise with its message, at once.
    """
    if comm.group_size(cp_group) == 1:
        _raise(failure)
        return
    settings = settings or {}
    codes = [_setting_code(value, choices) for value, choices in settings.values()]
    device = exchange_device("meta" if failure is not None else weight.device, cp_group)
    checksum = 0 if failure is not None else weight_checksum(weight)
    table = comm.handshake([int(failure is not None), checksum] + codes, cp_group, device)
    _raise_on_rejection(table, failure, cp_group, device)
    for i, (label, (_, choices)) in enumerate(settings.items(), start=2):
        values = [row[i] for row in table]
        if len(set(values)) > 1:
            shown = [choices[v] if choices and 0 <= v < len(choices) else v for v in values]
            raise ValueError(f"CP ranks disagree on {label}: {shown} (by rank); every CP rank "
                             "must be configured alike (no process group was built)")
    sums = [row[1] for row in table]
    if len(set(sums)) > 1:
        differ = [r for r, s in enumerate(sums) if s != sums[0]]
        raise ValueError(
            f"{name} differs between CP ranks: CP rank(s) {differ} hold other values than CP "
            f"rank 0 (checksums by rank {sums}); every rank of cp_group must hold the same "
            f"{name} (the CP ranks of one TP rank are replicas: load or initialize the weights "
            "with the same seed and keep them in sync through the data-parallel reduction)")


def _setting_code(value, choices) -> int:
    """A setting as an int64: its index among ``choices``, else the int itself."""
    if choices:
        return choices.index(value) if value in choices else UNKNOWN
    return int(value)


_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # odd int64: position-dependent weights, mod 2^64


def weight_checksum(weight) -> int:
    """An exact, order-independent checksum of a tensor's bits (int64 arithmetic wraps).

    The bits rather than the values: a float sum depends on the reduction order
    (thread counts), bits summed as integers do not. Each element is weighted
    by an odd function of its column and each row sum by one of its row, so
    swapped elements or rows change the sum."""
    flat = weight.detach()
    flat = flat.reshape(-1, flat.shape[-1]) if flat.dim() > 1 else flat.reshape(1, -1)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    bits = flat.view(width)
    device = bits.device
    cols = torch.arange(bits.shape[1], dtype=torch.int64, device=device) * 2 + 1
    total = torch.zeros((), dtype=torch.int64, device=device)
    step = max(1, _CHUNK // bits.shape[1])
    for start in range(0, bits.shape[0], step):  # int64 temporaries of one chunk at a time
        rows = (bits[start:start + step].to(torch.int64) * cols).sum(1)
        row_weight = torch.arange(start, start + rows.numel(), dtype=torch.int64, device=device)
        total += (rows * ((row_weight * 2 + 1) * _MIX)).sum()
    return int(total.item())


_CHUNK = 1 << 21


def _raise_on_difference(table: List[List[int]], names: Dict[str, Sequence[str]],
                         details: Dict[str, Sequence[int]], cp_group, device) -> None:
    stage = FIELDS.index("stage")
    if len({row[stage] for row in table}) > 1:
        by_rank = [STAGES[row[stage]] if 0 <= row[stage] < len(STAGES) else row[stage]
                   for row in table]
        if set(by_rank) <= {"attention", "start_latent_gather"}:
            raise ValueError(
                f"CP ranks disagree on latent_gather: the ranks' calls are {by_rank}; every "
                "rank must start the overlapped gather (start_latent_gather + latent_gather=) "
                "or none")
        raise ValueError(
            f"CP ranks are in different calls: {by_rank} (by rank); every rank of cp_group "
            "must make the same LAGA calls in the same order (the same modules, the same "
            "micro-batches, agreement.settle on every rank alike)")
    for i, field in enumerate(FIELDS[2:], start=2):
        values = [row[i] for row in table]
        if field not in ("calls", "content") and len(set(values)) > 1:
            if field in details:  # every rank sees the same table, so all gather together
                detail = details[field]
                shown = _gather_detail(detail() if callable(detail) else detail, cp_group,
                                       device)
            else:
                shown = [_show(field, v, names) for v in values]
            raise ValueError(f"CP ranks disagree on {LABELS.get(field, field)}: {shown} (by "
                             "rank); every rank of cp_group must pass the same value")


def _raise_on_calls(table: List[List[int]], names, on_calls, cp_group, device) -> None:
    """The digests of the calls that exchanged nothing differ: gather each rank's distinct
    rows (on this path only) and name the first field that differs."""
    calls, content = FIELDS.index("calls"), FIELDS.index("content")
    if len({row[content] for row in table}) > 1 and len({row[calls] for row in table}) < 2:
        raise ValueError(
            f"CP ranks disagree on key_padding_mask in a later call: its contents differ "
            "(compared on the device; the calls after the first of a micro-batch exchange "
            "nothing: the difference was found at the next agreement, before any optimizer "
            "step); every rank of cp_group must pass the same value")
    if len({row[calls] for row in table}) < 2:
        return
    flat = _gather_detail(on_calls() if on_calls is not None else [], cp_group, device,
                          shorten=False)
    width = len(FIELDS)
    rows = [[tuple(f[i:i + width]) for i in range(0, len(f or []), width)] for f in flat]
    why = "(the calls after the first of a micro-batch exchange nothing: the difference " \
          "was found at the next agreement, before any optimizer step)"
    for k in range(max(len(r) for r in rows)):
        kth = [r[k] if k < len(r) else None for r in rows]
        if any(row is None for row in kth):
            raise ValueError(f"CP ranks made different LAGA calls in a micro-batch {why}; "
                             "every rank of cp_group must run the same modules in the same "
                             "order")
        for i, field in enumerate(FIELDS[2:], start=2):
            values = [row[i] for row in kth]
            if len(set(values)) > 1:
                shown = [_show(field, v, names) for v in values]
                raise ValueError(f"CP ranks disagree on {LABELS.get(field, field)} in a later "
                                 f"call: {shown} (by rank) {why}; every rank of cp_group must "
                                 "pass the same value")
    raise ValueError(f"CP ranks made their LAGA calls in a different order or number {why}; "
                     "every rank of cp_group must run the same modules in the same order")


def _gather_detail(mine: Sequence[int], cp_group, device, shorten: bool = True) -> List[object]:
    """Every rank's full value (a list of ints of any length): two small exchanges."""
    lengths = [row[0] for row in comm.handshake([len(mine)], cp_group, device)]
    padded = list(mine) + [UNKNOWN] * (max(lengths) - len(mine))
    table = comm.handshake(padded or [UNKNOWN], cp_group, device)
    keep = _shorten if shorten else list
    return [keep(row[:n]) if n else None for row, n in zip(table, lengths)]


def _shorten(values: List[int], keep: int = 12):
    return values if len(values) <= keep else values[:keep // 2] + ["..."] + values[-keep // 2:]


def _show(field: str, value: int, names: Dict[str, Sequence[str]]):
    if value == UNKNOWN:
        return "unknown"
    if field in ("softmax_scale", "loss_coeff"):
        return bits_float(value)
    if field == "dtype" and 0 <= value < len(DTYPES):
        return str(DTYPES[value])
    if field == "requires_grad":
        return _grad_names(value)
    if field in names and 0 <= value < len(names[field]):
        return names[field][value]
    if field in ("causal", "check_ranks", "recompute_kv", "trim_causal_prefix",
                 "latent_gather"):
        return bool(value)
    return value


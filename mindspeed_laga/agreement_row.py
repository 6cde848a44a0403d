"""The agreement row of a dense form's call: what every CP rank must pass alike, as int64.

``checks.check`` validates a call on this rank; :func:`agree_on_call` then hands the
row built here to the ranks' agreement (agreement.py decides whether the call exchanges
it, folds it into the micro-batch's digest or skips). Every value comes from host
facts (options, shapes, the documents' boundaries); the key padding's code is read
from the device once per micro-batch at most (key_padding_digest.py).
"""
from __future__ import annotations

import hashlib
import math
import numbers
import struct
from typing import Dict, Optional

import torch

from . import agreement, comm, handshake
from .cp_algos import ALGOS
from .key_padding_digest import padding_code, padding_counts
from .options import AttnOptions
from .vocab.dims import MLADims
from .vocab.names import ATTN_CP_ALGOS, EMPTY_ROWS, FORMS, LAYOUTS


def agree_on_call(o: AttnOptions, tensors, dims, documents, failure) -> None:
    """The agreement of this call (agreement.py decides whether it exchanges, folds or
    skips, alike on every rank). Raises ``failure`` here on this rank."""
    if comm.group_size(o.cp_group) == 1:
        if failure is not None:
            raise failure
        return
    query = tensors[0]
    device = query.device if isinstance(query, torch.Tensor) else "cpu"
    mask = o.key_padding_mask

    def row() -> Dict[str, int]:
        values = _agreed_values(o, tensors, dims)
        values["ulysses_degree"] = _ulysses_degree_value(o.cp_algo, o.ulysses_group)
        # a hash of the boundaries, once per micro-batch (the later calls pass the same ones)
        values["documents"] = agreement.memo(o.cp_group, ("documents", documents),
                                             lambda: documents_code(documents))
        values["key_padding"] = agreement.content_code(
            o.cp_group, "key_padding", mask, lambda: padding_code(mask)) \
            if isinstance(mask, torch.Tensor) else 0
        return values

    details = {"documents": list(documents or ()),
               "key_padding": (lambda: []) if mask is None else (lambda: padding_counts(mask))}
    agreement.agree_call(o.cp_group, o.check_ranks, failure, device, row, names=_NAMES,
                         details=details)


_NAMES = {"empty_rows": EMPTY_ROWS, "form": FORMS, "cp_algo": ATTN_CP_ALGOS, "layout": LAYOUTS,
          "stage": handshake.STAGES}


def _code(choices, value) -> int:
    known = isinstance(value, str) and value in choices
    return choices.index(value) if known else handshake.UNKNOWN


def _flag(value) -> int:
    """An option as the handshake's integer (-1 when it is not a valid value)."""
    return int(value) if isinstance(value, bool) else handshake.UNKNOWN


def _agreed_values(o: AttnOptions, tensors, dims: Optional[MLADims]) -> Dict[str, int]:
    """What every rank must agree on, as integers (unknown values stay out)."""
    query = tensors[0]
    values = {"stage": 0, "check_ranks": int(o.check_ranks is not False),
              "form": _code(FORMS, o.form), "cp_algo": _code(ATTN_CP_ALGOS, o.cp_algo),
              "layout": _code(LAYOUTS, o.layout), "empty_rows": _code(EMPTY_ROWS, o.empty_rows)}
    if isinstance(o.causal, bool):
        values["causal"] = int(o.causal)
    if (isinstance(o.softmax_scale, numbers.Real) and not isinstance(o.softmax_scale, bool)
            and _finite(o.softmax_scale)):
        values["softmax_scale"] = handshake.float_bits(o.softmax_scale)
    if dims is not None:
        values.update(local_len=query.shape[0], micro_batch=query.shape[1], heads=dims.heads,
                      qk_head_dim=dims.qk_head_dim, rope_dim=dims.rope_dim,
                      v_head_dim=dims.v_head_dim, kv_lora_rank=dims.kv_lora_rank,
                      dtype=handshake.dtype_code(query.dtype),
                      requires_grad=handshake.grad_pattern(dict(zip(handshake.INPUTS, tensors))))
    if o.form == "laga":
        block = o.kv_block_size
        values.update(recompute_kv=_flag(o.recompute_kv),
                      trim_causal_prefix=_flag(o.trim_causal_prefix),
                      kv_block_size=block if isinstance(block, int) and not isinstance(block, bool)
                      else 0, latent_gather=int(o.latent_gather is not None),
                      kv_up_linear=kv_up_linear_code(o.kv_up_linear))
    return values


def kv_up_linear_code(linear) -> int:
    """The up-projection as an int64 for the agreement: 0 for F.linear (None); else the
    function's ``agreement_code`` (an adapter's code of its FP8 recipe and scales), or 1."""
    if linear is None:
        return 0
    code = getattr(linear, "agreement_code", 1)
    return code if isinstance(code, int) and not isinstance(code, bool) else 1


def documents_code(documents) -> int:
    """The document boundaries as one int64 for the handshake (0: no documents)."""
    if documents is None:
        return 0
    digest = hashlib.blake2b(repr(documents).encode(), digest_size=8).digest()
    return struct.unpack("<q", digest)[0] or 1


def _ulysses_degree_value(cp_algo, ulysses_group) -> int:
    """U for the handshake (-1 when unknown), so ranks that differ on it raise alike."""
    if not _takes_degree(cp_algo) and ulysses_group is None:
        return 1
    try:
        return comm.group_size(ulysses_group)
    except Exception:
        return handshake.UNKNOWN


def _finite(x) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond float range (10**400)
        return False


def _takes_degree(cp_algo) -> bool:
    """Whether ``cp_algo`` (as passed: maybe not an algorithm) takes a Ulysses group."""
    known = ALGOS.get(cp_algo) if isinstance(cp_algo, str) else None
    return known is not None and known.takes_ulysses_degree

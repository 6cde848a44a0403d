"""The rows of the dense forms' calls and of ``start_latent_gather``, from host facts only
(options, shapes, documents; key padding through ``content_code``), built once the local
checks passed (a failed rank sends its message, not a row). Sparse MLA's row is built
beside its checks (sparse/checks.py)."""
from __future__ import annotations

from typing import Dict

import torch

from .. import comm
from ..cp_algos import ALGOS
from ..options import AttnOptions
from ..vocab.names import ATTN_CP_ALGOS, EMPTY_ROWS, FORMS, LAYOUTS
from . import inband
from .content import documents_code, padding_code, padding_counts
from .fields import INPUTS, KERNELS, STAGES, choice_code, dtype_code, float_bits, grad_pattern
from .schedule import agree_call, content_code, memo, note_weight


def agree_on_call(o: AttnOptions, tensors, dims, documents, failure, cache=None) -> None:
    """The agreement of a dense form's call; raises ``failure`` on this rank. ``cache``: a
    dict kept for calls like this one (checks.py), where its row's fixed part is built once."""
    if comm.group_size(o.cp_group) == 1:
        if failure is not None:
            raise failure
        return
    query, mask = tensors[0], o.key_padding_mask
    device = query.device if isinstance(query, torch.Tensor) else "cpu"
    note_weight(tensors[3])
    cache = {} if cache is None else cache

    def row() -> Dict[str, int]:
        fixed = cache.get("row") or cache.setdefault("row", dict(
            _options_values(o), local_len=query.shape[0], micro_batch=query.shape[1],
            heads=dims.heads, qk_head_dim=dims.qk_head_dim, rope_dim=dims.rope_dim,
            v_head_dim=dims.v_head_dim, kv_lora_rank=dims.kv_lora_rank,
            dtype=dtype_code(query.dtype), documents=memo(
                o.cp_group, ("documents", documents), lambda: documents_code(documents))))
        return dict(fixed, requires_grad=grad_pattern(dict(zip(INPUTS, tensors))),
                    key_padding=0 if mask is None else content_code(
                        o.cp_group, "key_padding", mask, lambda: padding_code(mask)))

    details = {"documents": list(documents or ()),
               "key_padding": (lambda: []) if mask is None else (lambda: padding_counts(mask))}
    gathers = o.form in ("laga", "absorbed") and o.cp_algo == "allgather"  # its 1st collective
    with inband.joined(o.cp_group, "latent" if gathers and o.latent_gather is None else None):
        agree_call(o.cp_group, o.check_ranks, failure, device, row, details=details,
                   values=lambda: call_tensors(tensors[3], o.kv_up_linear))


def call_tensors(kv_up_weight, linear) -> list:
    """What a later call's in-band code hashes on the device: the weight (which layer it
    is) and ``linear.agreement_tensors()`` (an FP8 hook's scales), if any."""
    found = [kv_up_weight] if isinstance(kv_up_weight, torch.Tensor) else []
    more = getattr(linear, "agreement_tensors", None)
    return found + [t for t in (more() if callable(more) else more or ())
                    if isinstance(t, torch.Tensor)]


def _options_values(o: AttnOptions) -> Dict[str, int]:
    values = {"stage": STAGES.index("attention"), "check_ranks": int(o.check_ranks is not False),
              "form": choice_code(FORMS, o.form), "cp_algo": choice_code(ATTN_CP_ALGOS, o.cp_algo),
              "layout": choice_code(LAYOUTS, o.layout),
              "empty_rows": choice_code(EMPTY_ROWS, o.empty_rows),
              "kernel": choice_code(KERNELS, o.kernel),
              "ulysses_degree": _ulysses_degree(o.cp_algo, o.ulysses_group),
              "causal": int(o.causal), "softmax_scale": float_bits(o.softmax_scale)}
    if o.form == "laga":
        values.update(recompute_kv=int(o.recompute_kv), kv_block_size=o.kv_block_size or 0,
                      trim_causal_prefix=int(o.trim_causal_prefix),
                      latent_gather=int(o.latent_gather is not None),
                      kv_up_linear=kv_up_linear_code(o.kv_up_linear))
    return values


def gather_row(kv_latent, k_pos_emb, check_ranks, ok: bool) -> Dict[str, int]:
    """The row of ``start_latent_gather`` (``ok``: its local checks passed)."""
    values = {"stage": STAGES.index("start_latent_gather"),
              "check_ranks": int(check_ranks is not False), "latent_gather": 1}
    if ok:
        values.update(local_len=kv_latent.shape[0], micro_batch=kv_latent.shape[1],
                      kv_lora_rank=kv_latent.shape[2], rope_dim=k_pos_emb.shape[2],
                      dtype=dtype_code(kv_latent.dtype),
                      requires_grad=grad_pattern({"kv_latent": kv_latent,
                                                  "k_pos_emb": k_pos_emb}))
    return values


def kv_up_linear_code(linear) -> int:
    """The up-projection as an int64: 0 for F.linear (None); else the function's
    ``agreement_code`` (an adapter's code of its FP8 recipe), or a digest of what the
    function is (module, name, bytecode), alike on every rank that runs the same code."""
    if linear is None:
        return 0
    code = getattr(linear, "agreement_code", None)
    if isinstance(code, int) and not isinstance(code, bool):
        return code
    target = getattr(linear, "func", linear)  # functools.partial: what it calls
    body = getattr(target, "__code__", None)
    return documents_code((getattr(target, "__module__", None), type(target).__qualname__,
                           getattr(target, "__qualname__", None), getattr(body, "co_code", None),
                           getattr(body, "co_firstlineno", None)))


def _ulysses_degree(cp_algo, ulysses_group) -> int:
    known = ALGOS.get(cp_algo)
    if (known is not None and known.takes_ulysses_degree) or ulysses_group is not None:
        return comm.group_size(ulysses_group)
    return 1

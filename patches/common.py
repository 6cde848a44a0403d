"""What both host patches share: the first-call checks (shapes, the same weights), the
overlapped gather and the error an untested host raises.

Every CP rank runs the same modules in the same order, so the ranks agree on
shapes on a module's first call only and skip the exchange together later
(no host sync per step). The first call also checks that every CP rank holds
the same ``kv_up_weight`` (one more small exchange: a checksum).
"""
from __future__ import annotations

from typing import Optional

from mindspeed_laga import handshake


def first_call(module) -> bool:
    """True on the module's first LAGA call (the ranks check shapes then), False after."""
    first = not getattr(module, "_laga_checked", False)
    module._laga_checked = True
    return first


def check_weight_once(first: bool, kv_up_weight, cp_group) -> None:
    """On a module's first call: every CP rank must hold the same kv_up_weight (ValueError on
    every rank otherwise; one exchange of one int64, docs/RESULTS.md has its cost)."""
    if first:
        handshake.check_same_weight(kv_up_weight, cp_group)


def start_gather(overlap: bool, kv_latent, k_pos_emb, cp_group, check_ranks: bool) -> Optional[object]:
    """With overlap, launch the latent all-gather now (the query projection hides it); else None."""
    if not overlap:
        return None
    from mindspeed_laga import start_latent_gather
    return start_latent_gather(kv_latent, k_pos_emb, cp_group=cp_group, check_ranks=check_ranks)


class UnsupportedHostError(RuntimeError):
    """The installed host differs from every version the patch was written for."""

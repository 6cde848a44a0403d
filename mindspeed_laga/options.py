"""The options of one attention call, as one frozen record.

``api.py`` builds it once from the keywords the caller passed (as passed:
nothing is converted or checked here); ``checks.check`` checks it once and
turns it into the integers of the cross-rank handshake. The forms read the
checked values from the :class:`~mindspeed_laga.vocab.AttnSetup` that
validation returns, never from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True, eq=False)
class AttnOptions:
    """Every keyword of ``laga_attention`` / ``explicit_attention`` / ``absorbed_attention``.

    ``form`` names the public function; the four LAGA-only options keep their
    defaults for the other forms (their signatures do not take them).
    """

    form: str
    softmax_scale: Any
    cp_group: Any = None
    cp_algo: Any = "allgather"
    layout: Any = "zigzag"
    causal: Any = True
    kernel: Any = "auto"
    check_ranks: Any = None
    qk_head_dim: Any = None
    v_head_dim: Any = None
    cu_seqlens: Any = None
    pad_v: Any = False
    ulysses_group: Any = None
    key_padding_mask: Any = None
    empty_rows: Any = "mean"
    # laga_attention only
    trim_causal_prefix: Any = False
    recompute_kv: Any = False
    kv_block_size: Optional[Any] = None
    latent_gather: Any = None

    @property
    def blockwise(self) -> bool:
        """Whether the call takes the blockwise recompute path (kernel resolution differs)."""
        return self.recompute_kv is True

"""The options of one attention call, as one frozen record.

``api.py`` builds it once from the keywords the caller passed (``AttnOptions.of``: the
public signatures name each field once more, and a test keeps the two equal; as passed:
nothing is converted or checked here, so the types below are what a valid
call passes); ``checks.check`` checks it once and turns it into the integers
of the cross-rank handshake. The forms read the checked values from the
:class:`~mindspeed_laga.vocab.AttnSetup` that validation returns, and LAGA's
own options from :attr:`AttnOptions.laga`, never a second copy.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional


@dataclass(frozen=True)
class LagaOptions:
    """What ``laga_attention`` takes beyond the other forms (docs/BEYOND.md)."""

    trim_causal_prefix: bool = False
    recompute_kv: bool = False
    kv_block_size: Optional[int] = None
    latent_gather: Optional[object] = None  # forms.latent_source.LatentGather
    kv_up_linear: Optional[object] = None   # (latent, weight rows, first row) -> K/V


@dataclass(frozen=True, eq=False)
class AttnOptions:
    """Every keyword of ``laga_attention`` / ``explicit_attention`` / ``absorbed_attention``.

    ``form`` names the public function; the four LAGA-only options keep their
    defaults for the other forms (their signatures do not take them).
    """

    form: str
    softmax_scale: float
    cp_group: Optional[object] = None             # torch.distributed ProcessGroup
    cp_algo: str = "allgather"                    # a name of cp_algos.ALGOS
    layout: str = "zigzag"
    causal: bool = True
    kernel: str = "auto"                          # "auto" or a name of kernels.KERNEL_TYPES
    check_ranks: Optional[bool] = None
    qk_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    cu_seqlens: Optional[object] = None           # a 1-D integer tensor or a list of ints
    pad_v: bool = False
    ulysses_group: Optional[object] = None        # hybrid only: a ProcessGroup
    key_padding_mask: Optional[object] = None     # bool [b, S], True = padding key
    empty_rows: str = "mean"                      # a name of vocab.names.EMPTY_ROWS
    # laga_attention only
    trim_causal_prefix: bool = False
    recompute_kv: bool = False
    kv_block_size: Optional[int] = None
    latent_gather: Optional[object] = None
    kv_up_linear: Optional[object] = None

    @classmethod
    def of(cls, form: str, passed: dict) -> "AttnOptions":
        """The record of a call of the public ``form`` function, from its keywords as passed
        (``locals()``: the signature's defaults included; the tensors are no field)."""
        return cls(form=form, **{name: passed[name] for name in _KEYWORDS if name in passed})

    @property
    def blockwise(self) -> bool:
        """Whether the call takes the blockwise recompute path (kernel resolution differs)."""
        return self.recompute_kv is True

    @property
    def laga(self) -> LagaOptions:
        """LAGA's own options as the one record ``laga_forward`` reads."""
        return LagaOptions(trim_causal_prefix=self.trim_causal_prefix,
                           recompute_kv=self.recompute_kv, kv_block_size=self.kv_block_size,
                           latent_gather=self.latent_gather, kv_up_linear=self.kv_up_linear)


# The keywords AttnOptions.of reads (every field but ``form``), listed once.
_KEYWORDS = tuple(f.name for f in fields(AttnOptions) if f.name != "form")

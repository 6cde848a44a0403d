"""One record of a variant to run or model: a form plus LAGA's options.

Shared by the cost model (``costmodel``), the CLI (``plan``, ``bench``,
``verify``) and the multi-rank runner (``equivalence.Case``). Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

from ..vocab.names import FORMS

# laga_attention's keywords a variant may set (``overlap`` is not one: it starts the
# latent gather before the call and hands it over as ``latent_gather``).
OPTION_NAMES = ("trim_causal_prefix", "recompute_kv", "kv_block_size")


@dataclass(frozen=True)
class RunSpec:
    """A form plus LAGA's options, under a display name."""

    name: str
    form: str
    trim_causal_prefix: bool = False
    recompute_kv: bool = False
    kv_block_size: Optional[int] = None   # with recompute_kv; None = one block of every key
    overlap: bool = False                 # latent gather started before the query projection
    query_projection: bool = False        # bench: run a stand-in query projection first
    pad_v: bool = False                   # kernel npu: V zero-padded to the q/k head dim

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"form={self.form!r} is unknown; use one of {FORMS}")
        if self.kv_block_size is not None and (not isinstance(self.kv_block_size, int)
                                               or self.kv_block_size <= 0):
            raise ValueError(f"kv_block_size must be a positive integer, got {self.kv_block_size!r}")

    def options(self) -> dict:
        """The ``laga_attention`` keywords this variant sets (defaults left out)."""
        opts = {}
        if self.trim_causal_prefix:
            opts["trim_causal_prefix"] = True
        if self.recompute_kv:
            opts["recompute_kv"] = True
        if self.kv_block_size:
            opts["kv_block_size"] = self.kv_block_size
        if self.pad_v:
            opts["pad_v"] = True
        return opts

    def option_items(self) -> Tuple[tuple, ...]:
        """Options as ((name, value), ...), ``("overlap", True)`` last when set."""
        return tuple(self.options().items()) + ((("overlap", True),) if self.overlap else ())

    @classmethod
    def from_options(cls, name: str, form: str, options: Iterable[tuple]) -> "RunSpec":
        """From ``((keyword, value), ...)`` (an ``("overlap", True)`` item included)."""
        opts = dict(options)
        unknown = sorted(set(opts) - set(OPTION_NAMES) - {"overlap", "pad_v"})
        if unknown:
            raise ValueError(f"options {unknown} are unknown; use {OPTION_NAMES}, 'overlap' or 'pad_v'")
        return cls(name, form, trim_causal_prefix=bool(opts.get("trim_causal_prefix", False)),
                   recompute_kv=bool(opts.get("recompute_kv", False)),
                   kv_block_size=opts.get("kv_block_size"), overlap=bool(opts.get("overlap", False)),
                   pad_v=bool(opts.get("pad_v", False)))


def standard_runs(block_size: Optional[int] = None, *, overlap: bool = True,
                  query_projection_pair: bool = False, forms_only: bool = False) -> List[RunSpec]:
    """The three forms and LAGA's options, in table order.

    ``block_size``: adds the blockwise rows. ``query_projection_pair``: the
    overlap row gets a twin without overlap ("laga+qproj"), both running the
    same stand-in query projection, so a measured difference is the overlap's.
    """
    out = [RunSpec(f, f) for f in FORMS]
    if forms_only:
        return out
    out += [RunSpec("laga+trim", "laga", trim_causal_prefix=True),
            RunSpec("laga+recompute", "laga", recompute_kv=True)]
    if block_size:
        out += [RunSpec("laga+blockwise", "laga", recompute_kv=True, kv_block_size=block_size),
                RunSpec("laga+blockwise+trim", "laga", trim_causal_prefix=True, recompute_kv=True,
                        kv_block_size=block_size)]
    if overlap:
        if query_projection_pair:
            out.append(RunSpec("laga+qproj", "laga", query_projection=True))
        out.append(RunSpec("laga+overlap", "laga", overlap=True, query_projection=query_projection_pair))
    return out

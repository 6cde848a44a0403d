"""The CP algorithms, one class each, and their registry.

``algo(name)`` -> the :class:`CPAlgo` of that name (ValueError for an unknown
one). Adding an algorithm: a ``CPAlgo`` subclass in its own module and one line
in ``_REGISTERED`` below (docs/DESIGN.md, "Extension points").
"""
from __future__ import annotations

from typing import Dict

from .allgather import AllGather
from .base import CPAlgo, Exchange, SplitView
from .hybrid import Hybrid
from .ulysses import Ulysses

_REGISTERED = (
    AllGather(),
    Ulysses(),
    Hybrid(),
)
ALGOS: Dict[str, CPAlgo] = {a.name: a for a in _REGISTERED}


def algo(name) -> CPAlgo:
    """The algorithm called ``name``."""
    found = ALGOS.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"cp_algo={name!r} is unknown; use one of {tuple(ALGOS)}")
    return found


def takes_ulysses_degree(name) -> bool:
    """Whether ``name`` is an algorithm that takes a Ulysses degree (for the CLI, whose
    choices also hold "both")."""
    return isinstance(name, str) and name in ALGOS and ALGOS[name].takes_ulysses_degree


__all__ = ["ALGOS", "AllGather", "CPAlgo", "Exchange", "Hybrid", "SplitView", "Ulysses", "algo", "takes_ulysses_degree"]

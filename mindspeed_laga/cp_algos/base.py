"""What a CP algorithm is: the one object the forms, checks, cost model, CLI and adapters ask.

A CP algorithm decides whether heads are split (and over which group), which
queries a rank attends, which layout its host pipeline produces, and what
crosses the wire. Everything that differs between algorithms is a method or
attribute of :class:`CPAlgo`; nothing else compares algorithm names. Adding one
is a subclass in its own module plus one line in ``cp_algos/__init__.py``
(docs/DESIGN.md, "Extension points"). Torch-free: the cost model uses it too.
"""
from __future__ import annotations

import functools
from typing import ClassVar, List, NamedTuple


class Exchange(NamedTuple):
    """One collective of a forward pass: its kind, the byte counter's tag, the values per
    local token handed to it, and the byte counter's name of its group ("cp", "ulysses",
    "ring"). Backward runs the same collectives (an all-gather's backward a reduce-scatter)."""
    kind: str
    tag: str
    width: int
    group: str


class CPAlgo:
    """One CP algorithm (stateless; one instance in the registry)."""

    name: ClassVar[str]
    # The split its host data pipeline produces when a caller names none.
    default_layout: ClassVar[str]
    # MindSpeed's --context-parallel-algo that runs it (the training flag plan prints;
    # features/laga_args.py maps each host value back to an algorithm and a layout).
    # "": no MindSpeed algorithm runs it, so plan prints no training flags for it.
    host_algo: ClassVar[str] = ""
    # Whether it takes a Ulysses group of U ranks (``ulysses_group`` / ``ulysses_degree``).
    takes_ulysses_degree: ClassVar[bool] = False
    # Whether the cost model's one-link tables and the CLI's "both" enumerate it.
    in_tables: ClassVar[bool] = True
    # The byte counter's name of the group heads are split over.
    split_label: ClassVar[str] = "cp"
    # The kernel's query rows after the all-to-all, as the cost model's terms name them.
    split_rows_label: ClassVar[str] = "S"

    # ---- heads: whether, over how many ranks, over which group

    def heads_split(self, cp_size: int, ulysses_degree: int = 1) -> bool:
        """Heads split over the split group: Q goes out and O comes back by all-to-all."""
        return False

    def split_size(self, cp_size: int, ulysses_degree: int = 1) -> int:
        """Ranks the heads are split over (when :meth:`heads_split`)."""
        return cp_size

    def split_rank(self, cp_rank: int, ulysses_degree: int = 1) -> int:
        return cp_rank

    def split_group(self, cp_group, ulysses_group):
        """The group the head all-to-alls run over."""
        return cp_group

    def heads_divide(self, heads: int, cp_size: int, ulysses_degree: int = 1) -> bool:
        """The divisibility rule: the heads (of one TP rank) split evenly over the split
        group. Every interface states its own message around this one rule."""
        return not self.heads_split(cp_size, ulysses_degree) or \
            heads % self.split_size(cp_size, ulysses_degree) == 0

    def degree_divides(self, cp_size: int, ulysses_degree: int) -> bool:
        """U is a positive divisor of the CP size (R = P/U ring ranks)."""
        return ulysses_degree >= 1 and cp_size % ulysses_degree == 0

    def attended_heads(self, heads: int, cp_size: int, ulysses_degree: int = 1) -> int:
        """Heads a rank attends: all, or its share of the split group's."""
        split = self.heads_split(cp_size, ulysses_degree)
        return heads // self.split_size(cp_size, ulysses_degree) if split else heads

    def query_len(self, local_len: int, cp_size: int, ulysses_degree: int = 1) -> int:
        """Queries a rank attends: its own, or every split-group rank's."""
        split = self.heads_split(cp_size, ulysses_degree)
        return self.split_size(cp_size, ulysses_degree) * local_len if split else local_len

    # ---- explicit form: per-head K/V after the head all-to-all

    def every_token(self, x, setup, tag: str):
        """Head-split K or V of the split group's tokens -> of every token, in CP rank
        order (the all-to-all over the whole CP group already delivered them)."""
        return x

    # ---- cost model: what crosses the wire in one forward pass

    def exchanges(self, form: str, d, n: int) -> List[Exchange]:
        """The collectives of ``form`` (d: ModelDims, n: heads of this TP rank)."""
        raise NotImplementedError


class SplitView:
    """The algorithm's answers for a record holding ``cp_algo``, ``cp_size`` and
    ``ulysses_degree`` (the forms' setup, the cost model's config): mixed in, so both
    ask the same object the same way."""

    @property
    def algo(self) -> CPAlgo:
        """The CP algorithm (cp_algos/): what differs between allgather, ulysses, hybrid."""
        return _registry()(self.cp_algo)

    @property
    def heads_split(self) -> bool:
        """Heads split over the split group: Q goes out and O comes back by all-to-all."""
        return self.algo.heads_split(self.cp_size, self.ulysses_degree)

    @property
    def split_size(self) -> int:
        """Ranks the heads are split over: P (ulysses) or U (hybrid)."""
        return self.algo.split_size(self.cp_size, self.ulysses_degree)


def latent_exchanges(form: str, d, n: int, query_group: str, latent_group: str = "cp"):
    """Absorbed and LAGA with heads split: Q out, the latent gathered, O back."""
    query_width = d.latent_dim if form == "absorbed" else d.qk_dim  # q_abs is latent-wide
    return [Exchange("all_to_all", "query", n * query_width, query_group),
            Exchange("all_gather", "latent", d.latent_dim, latent_group),
            Exchange("all_to_all", "output", n * d.v_head_dim, query_group)]


@functools.lru_cache(maxsize=None)
def _registry():
    """The registry's ``algo`` (cp_algos/__init__.py imports this module, so it is looked up
    on first use, then kept: an import statement per call costs host time)."""
    from . import algo
    return algo

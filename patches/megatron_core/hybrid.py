"""Hybrid CP for the megatron-core patch: the Ulysses sub-groups of the CP group.

``patch_megatron_mla(cp_algo="hybrid", ulysses_degree=U)``: CP rank c = r*U + u,
heads split inside the U consecutive CP ranks r*U .. r*U+U-1 (the Ulysses
group, one node), the latent all-gathered over the whole CP group
(docs/DESIGN.md "Hybrid CP"). megatron-core has no such group, so the patch
builds it: on the first covered forward, which every rank of the CP group
runs at the same point, each rank creates the group it belongs to
(``comm.ulysses_group``, with ``use_local_synchronization=True``, so only its
U members meet and other CP groups, e.g. of other data-parallel replicas,
need not call in step), cached per CP group and degree.

The batch split this expects is the hybrid zigzag (2R chunks, R = P/U, ring
rank r taking chunks r and 2R-1-r, that pair cut into U contiguous pieces),
not the plain zigzag of megatron's ``get_batch_on_this_cp_rank``: shard with
``mindspeed_laga.layout.shard(t, "zigzag", P, c, dim=1, ulysses_degree=U)``.
"""
from __future__ import annotations

from mindspeed_laga.cp_algos import algo
from mindspeed_laga.vocab.names import HYBRID


def check_ulysses_degree(cp_algo: str, ulysses_degree) -> int:
    """Patch-time check of ``ulysses_degree`` (ValueError naming it) -> U (1: not hybrid)."""
    if not algo(cp_algo).takes_ulysses_degree:
        if ulysses_degree is not None:
            raise ValueError(f"patch_megatron_mla(ulysses_degree={ulysses_degree!r}) needs "
                             f"cp_algo='hybrid' (got cp_algo={cp_algo!r}); drop ulysses_degree "
                             "or pass cp_algo='hybrid'")
        return 1
    if ulysses_degree is None:
        raise ValueError("patch_megatron_mla(cp_algo='hybrid') needs ulysses_degree=U: the number "
                         "of consecutive CP ranks (one node) that split the heads")
    if isinstance(ulysses_degree, bool) or not isinstance(ulysses_degree, int) \
            or ulysses_degree < 1:
        raise ValueError(f"patch_megatron_mla(ulysses_degree={ulysses_degree!r}) must be a "
                         "positive int dividing the CP size")
    return ulysses_degree


def check_hybrid_shape(ulysses_degree: int, cp_size: int, heads: int) -> None:
    """Forward-time checks, on every CP rank before any group or collective exists."""
    split = algo(HYBRID)
    if not split.degree_divides(cp_size, ulysses_degree):
        raise ValueError(f"patch_megatron_mla(ulysses_degree={ulysses_degree}) does not divide "
                         f"the context-parallel size {cp_size}; pick a divisor of "
                         f"--context-parallel-size")
    if not split.heads_divide(heads, cp_size, ulysses_degree):
        raise ValueError(f"patch_megatron_mla(ulysses_degree={ulysses_degree}): the {heads} "
                         f"attention heads of this tensor-parallel rank do not divide by "
                         f"{ulysses_degree}; pick a ulysses_degree that divides the heads per "
                         "TP rank")

"""The choices a caller makes: forms, CP algorithms, layouts (kernels: ``kernels/registry.py``)."""
from __future__ import annotations

from ..cp_algos import ALGOS, Hybrid

FORMS = ("explicit", "absorbed", "laga")
# Every CP algorithm (cp_algos/: one class each, named there only), and those the cost
# model's one-link tables and the CLI's "both" enumerate. Hybrid CP (Ulysses inside a group
# of U ranks, the latent across the CP group) is offered by plan and bench on its own and in
# the two-link node table.
ATTN_CP_ALGOS = tuple(ALGOS)
CP_ALGOS = tuple(name for name, a in ALGOS.items() if a.in_tables)
# Those plan, bench and verify offer on their own, beside "both" (not in the one-link tables).
OWN_CP_ALGOS = tuple(name for name, a in ALGOS.items() if not a.in_tables)
HYBRID = Hybrid.name
LAYOUTS = ("zigzag", "contiguous", "doc_zigzag")
# The layouts of one unbroken sequence (doc_zigzag needs document boundaries).
SEQUENCE_LAYOUTS = ("zigzag", "contiguous")
# What a query row that sees no key at all returns (left padding's pad rows under the causal
# mask, or a sample that is all padding): "mean" = the mean of every value of its sequence,
# what a softmax over a row filled with one finite mask value gives (Megatron's unfused
# softmax, -10000; Hugging Face's eager attention, the dtype's minimum); "zero" = zero, what
# flash kernels give (torch SDPA, the NPU op with its invalid-row handling).
EMPTY_ROWS = ("mean", "zero")
# The split each algorithm's host data pipeline produces when a caller names none.
DEFAULT_LAYOUT = {name: a.default_layout for name, a in ALGOS.items()}

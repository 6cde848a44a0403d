"""The choices a caller makes: forms, CP algorithms, layouts, kernels."""
from __future__ import annotations

from ..cp_algos import ALGOS

FORMS = ("explicit", "absorbed", "laga")
# Every CP algorithm (cp_algos/: one class each), and those the cost model's one-link
# tables and the CLI's "both" enumerate. Hybrid CP (Ulysses inside a group of U ranks,
# the latent across the CP group) is offered by plan and bench on its own and in the
# two-link node table.
ATTN_CP_ALGOS = tuple(ALGOS)
CP_ALGOS = tuple(name for name, a in ALGOS.items() if a.in_tables)
HYBRID = "hybrid"
LAYOUTS = ("zigzag", "contiguous", "doc_zigzag")
# The layouts of one unbroken sequence (doc_zigzag needs document boundaries).
SEQUENCE_LAYOUTS = ("zigzag", "contiguous")
KERNELS = ("auto", "eager", "sdpa", "npu")
# The split each algorithm's host data pipeline produces when a caller names none.
DEFAULT_LAYOUT = {name: a.default_layout for name, a in ALGOS.items()}

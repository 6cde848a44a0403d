"""The choices a caller makes: forms, CP algorithms, layouts, kernels."""
from __future__ import annotations

FORMS = ("explicit", "absorbed", "laga")
CP_ALGOS = ("allgather", "ulysses")
# Hybrid CP (Ulysses inside a group of U ranks, the latent across the CP group):
# an algorithm of the attention core only, so it stays out of CP_ALGOS, which
# the cost model and the CLI enumerate.
HYBRID = "hybrid"
ATTN_CP_ALGOS = CP_ALGOS + (HYBRID,)
LAYOUTS = ("zigzag", "contiguous", "doc_zigzag")
# The layouts of one unbroken sequence (doc_zigzag needs document boundaries).
SEQUENCE_LAYOUTS = ("zigzag", "contiguous")
KERNELS = ("auto", "eager", "sdpa", "npu")
# The split each algorithm's host data pipeline produces when a caller names none.
DEFAULT_LAYOUT = {"allgather": "zigzag", "ulysses": "contiguous", HYBRID: "zigzag"}

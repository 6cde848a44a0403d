"""The byte counter against the per-token formulas of DESIGN.md section 2.

DESIGN counts, per token and layer, the values a rank hands to the
collectives times (P-1)/P. The counter reads the real tensors; these tests
check its totals equal the formulas exactly, forward and backward.
"""
import itertools

import pytest

from mindspeed_laga import equivalence as eq
from mindspeed_laga.spawn import run_on_ranks

SHAPE = eq.MLAShape(seq_len=32, heads=8, qk_head_dim=16, rope_dim=8, v_head_dim=12, kv_lora_rank=24)


def values_per_token(form, cp_algo, s):
    """DESIGN.md section 2 (explicit, LAGA) and the absorbed form's own exchange."""
    n, d_n, d_r, d_v, d_c = s.heads, s.qk_head_dim, s.rope_dim, s.v_head_dim, s.kv_lora_rank
    table = {
        ("explicit", "allgather"): n * (d_n + d_r + d_v),
        ("laga", "allgather"): d_c + d_r,
        ("absorbed", "allgather"): d_c + d_r,
        ("explicit", "ulysses"): n * (2 * (d_n + d_r) + 2 * d_v),
        ("laga", "ulysses"): n * (d_n + d_r + d_v) + (d_c + d_r),
        ("absorbed", "ulysses"): n * (d_c + d_r) + n * d_v + (d_c + d_r),
    }
    return table[(form, cp_algo)]


CASES = [eq.Case(form=f, cp_algo=a, layout=l, dtype=d, shape=SHAPE)
         for f, a, l, d in itertools.product(("explicit", "absorbed", "laga"), ("allgather", "ulysses"),
                                             ("zigzag", "contiguous"), ("float32", "bfloat16"))]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"cp{p}")
def measured(request):
    per_rank = run_on_ranks(eq.worker, request.param, CASES)
    return request.param, per_rank


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.label() for c in CASES])
def test_counter_matches_design_formula(measured, index):
    cp_size, per_rank = measured
    case = CASES[index]
    elem = 4 if case.dtype == "float32" else 2
    local_tokens = SHAPE.seq_len // cp_size * SHAPE.batch
    expected = values_per_token(case.form, case.cp_algo, SHAPE) * local_tokens * elem * (cp_size - 1) / cp_size
    for rank, results in enumerate(per_rank):
        got = results[index]["design_bytes"]
        assert got["forward"] == expected, (rank, got, expected)
        assert got["backward"] == expected, (rank, got, expected)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.label() for c in CASES])
def test_wire_bytes_follow_the_collective(measured, index):
    """All-gather/reduce-scatter send (P-1) shards; all-to-all sends (P-1)/P of its input."""
    cp_size, per_rank = measured
    for direction, kinds in per_rank[0][index]["comm"].items():
        for kind, sizes in kinds.items():
            if kind in ("all_gather", "reduce_scatter", "handshake"):
                assert sizes["wire"] == (cp_size - 1) * sizes["payload"], (direction, kind, sizes)
            else:
                assert sizes["wire"] * cp_size == (cp_size - 1) * sizes["payload"], (direction, kind, sizes)

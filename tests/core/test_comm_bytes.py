"""The byte counter against the per-token formulas of docs/DESIGN.md, section 'Communication'.

DESIGN counts, per token and layer, the values a rank hands to the
collectives times (P-1)/P. The counter reads the real tensors; these tests
check its totals equal the formulas exactly, forward and backward.
"""
import itertools

import pytest

from mindspeed_laga.tools import equivalence as eq
from mindspeed_laga.tools.measure import worker
from mindspeed_laga.tools.spawn import run_on_ranks

SHAPE = eq.MLAShape(seq_len=32, heads=8, qk_head_dim=16, rope_dim=8, v_head_dim=12, kv_lora_rank=24)


def values_per_token(form, cp_algo, s):
    """docs/DESIGN.md, section 'Communication' (explicit, absorbed, LAGA)."""
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
    per_rank = run_on_ranks(worker, request.param, CASES)
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


def tensors_moved(form, cp_algo, s, local_tokens):
    """Per forward pass, the tensors a rank hands over, by collective, as element counts
    from their shapes: an all-gather's input is this rank's shard [s, b, ...]; an
    all-to-all's input is [s, b, n, d] (heads scattered, sequence gathered)."""
    n, d_n, d_r, d_v, d_c = s.heads, s.qk_head_dim, s.rope_dim, s.v_head_dim, s.kv_lora_rank
    t = local_tokens
    moved = {
        ("explicit", "allgather"): {"all_gather": [t * n * (d_n + d_r), t * n * d_v]},    # K, V
        ("laga", "allgather"): {"all_gather": [t * (d_c + d_r)]},                         # latent
        ("absorbed", "allgather"): {"all_gather": [t * (d_c + d_r)]},
        ("explicit", "ulysses"): {"all_to_all": [t * n * (d_n + d_r), t * n * (d_n + d_r),  # q, K
                                                 t * n * d_v, t * n * d_v]},              # V, O
        ("laga", "ulysses"): {"all_to_all": [t * n * (d_n + d_r), t * n * d_v],          # q, O
                              "all_gather": [t * (d_c + d_r)]},
        ("absorbed", "ulysses"): {"all_to_all": [t * n * (d_c + d_r), t * n * d_v],      # q_abs, O
                                  "all_gather": [t * (d_c + d_r)]},
    }
    return moved[(form, cp_algo)]


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.label() for c in CASES])
def test_wire_bytes_from_tensor_shapes(measured, index):
    """What a rank sends: a ring all-gather passes its shard to each of the P-1 others
    (backward: the reduce-scatter sends P-1 shard-sized partial sums); an all-to-all
    keeps one of its P pieces and sends the other P-1."""
    cp_size, per_rank = measured
    case = CASES[index]
    elem = 4 if case.dtype == "float32" else 2
    local_tokens = SHAPE.seq_len // cp_size * SHAPE.batch
    moved = tensors_moved(case.form, case.cp_algo, SHAPE, local_tokens)
    expected = {}
    for kind, sizes in moved.items():
        if kind == "all_gather":
            sent = sum((cp_size - 1) * size * elem for size in sizes)
            expected[("forward", "all_gather")] = sent
            expected[("backward", "reduce_scatter")] = sent
        else:
            sent = sum((cp_size - 1) * (size // cp_size) * elem for size in sizes)
            expected[("forward", "all_to_all")] = expected[("backward", "all_to_all")] = sent
    for rank, results in enumerate(per_rank):
        got = {(direction, kind): sizes["wire"] for direction, kinds in results[index]["comm"].items()
               for kind, sizes in kinds.items() if kind != "handshake"}
        assert got == expected, (rank, got, expected)

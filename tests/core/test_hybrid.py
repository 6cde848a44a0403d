"""Hybrid CP (heads split inside a Ulysses group of U ranks, the latent or K/V
across the CP group): all three forms, both layouts, kernels eager/sdpa and the
stand-in npu, LAGA's options, for (P, U) in (4, 2), (8, 2), (8, 4); outputs and
all four grads against a float64 single-process MLA written here; bytes by
group; every new error on every rank.

Each (P, U) is ONE spawned run: every worker loops over all cases and returns
its per-case results, which the tests read from a module-scoped cache.
"""
import itertools
import math

import pytest
import torch
import torch.distributed as dist

from mindspeed_laga import api, layout
from mindspeed_laga import comm
from mindspeed_laga.comm import count_bytes
from mindspeed_laga import start_latent_gather
from mindspeed_laga.tools.cases import INPUTS, MLAShape, full_inputs as shape_inputs
from mindspeed_laga.tools.spawn import run_on_ranks
from support.raise_together import assert_raised_together, outcome
from support.variants import KERNELS, runs_on_accelerator
from mindspeed_laga.vocab.segments import query_segments, rank_segments

from support import fake_torch_npu

pytestmark = pytest.mark.timeout(900)

# S, b, n, d_n, d_r, d_v, d_c
S, B, N, D_N, D_R, D_V, D_C = 32, 1, 8, 8, 4, 8, 16
SCALE = 1 / math.sqrt(D_N + D_R)


def mla_shape(**override):
    dims = dict(seq_len=S, batch=B, heads=N, qk_head_dim=D_N, rope_dim=D_R, v_head_dim=D_V,
                kv_lora_rank=D_C)
    return MLAShape(**dict(dims, **override))


SIZES = [(4, 2), (8, 2), (8, 4)]
LAGA_OPTIONS = {
    "trim": dict(trim_causal_prefix=True),
    "recompute": dict(recompute_kv=True),
    "blockwise": dict(recompute_kv=True, kv_block_size=6, trim_causal_prefix=True),
    "overlap": dict(latent_gather=True),
    "all": dict(recompute_kv=True, kv_block_size=8, trim_causal_prefix=True, latent_gather=True),
}
CASES = [(f, lay, k, "plain") for f, lay, k in itertools.product(
    ("explicit", "absorbed", "laga"), ("zigzag", "contiguous"), KERNELS)]
CASES += [("laga", lay, k, opt) for lay, opt in itertools.product(("zigzag", "contiguous"), LAGA_OPTIONS)
          for k in (("eager", "npu") if "recompute_kv" in LAGA_OPTIONS[opt] else ("eager", "sdpa"))]
# The stand-in npu kernel runs float32 (as the fused kernel); the rest float64.
DTYPE = {k: torch.float32 if runs_on_accelerator(k) else torch.float64 for k in KERNELS}
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def tolerance(case):
    """float64 to 1e-10, except where the code accumulates in float32 by design:
    the npu stand-in's float32 softmax and the blockwise (recompute_kv) merge."""
    _, _, kernel, option = case
    blockwise = LAGA_OPTIONS.get(option, {}).get("recompute_kv", False)
    return TOLERANCE[torch.float32 if blockwise else DTYPE[kernel]]


def full_inputs(dtype=torch.float64):
    """The same full-sequence inputs on every rank and in the reference."""
    return shape_inputs(mla_shape(), seed=1234)  # float64; kv_up_weight scaled by D_C**-0.5 = 1/4


def mla_reference():
    """Plain softmax attention of MLA on the full sequence, float64, with autograd."""
    x = full_inputs()
    leaves = {k: x[k].clone().requires_grad_(True)
              for k in ("query", "kv_latent", "k_pos_emb", "kv_up_weight")}
    kv = (leaves["kv_latent"] @ leaves["kv_up_weight"].t()).view(S, B, N, D_N + D_V)
    k_nope, value = kv[..., :D_N], kv[..., D_N:]
    key = torch.cat([k_nope, leaves["k_pos_emb"].unsqueeze(2).expand(S, B, N, D_R)], dim=-1)
    scores = torch.einsum("qbnd,kbnd->bnqk", leaves["query"], key) * SCALE
    future = torch.ones(S, S, dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    out = torch.einsum("bnqk,kbnd->qbnd", probs, value).reshape(S, B, N * D_V)
    out.backward(x["grad_out"])
    return {"out": out.detach(), **{k: v.grad for k, v in leaves.items()}}



def run_case(rank, world, degree, ulysses_group, case):
    form, lay, kernel, option = case
    dtype = DTYPE[kernel]
    x = {k: v.to(dtype) for k, v in full_inputs().items()}
    local = {k: layout.shard(x[k], lay, world, rank, ulysses_degree=degree).requires_grad_(True)
             for k in ("query", "kv_latent", "k_pos_emb")}
    weight = x["kv_up_weight"].clone().requires_grad_(True)
    d_out = layout.shard(x["grad_out"], lay, world, rank, ulysses_degree=degree)
    options = dict(LAGA_OPTIONS.get(option, {}))
    cp_group = dist.group.WORLD
    with count_bytes() as counter:
        if options.pop("latent_gather", False):
            options["latent_gather"] = start_latent_gather(local["kv_latent"], local["k_pos_emb"],
                                                           cp_group=cp_group)
        out = api.FORMS[form](local["query"], local["kv_latent"], local["k_pos_emb"], weight,
                              softmax_scale=SCALE, cp_group=cp_group, cp_algo="hybrid",
                              layout=lay, kernel=kernel, ulysses_group=ulysses_group, **options)
        out.backward(d_out)
    traffic = {}
    for r in counter.records:
        if r.kind != "handshake":
            key = (r.group, r.kind, r.direction)
            traffic[key] = traffic.get(key, 0) + r.payload
    return {"out": out.detach(), "query": local["query"].grad, "kv_latent": local["kv_latent"].grad,
            "k_pos_emb": local["k_pos_emb"].grad, "kv_up_weight": weight.grad, "traffic": traffic,
            "group_sizes": {(r.group, r.kind): r.group_size for r in counter.records}}


def equivalence_worker(rank, world, degree, cases):
    module = fake_torch_npu.install()
    ulysses_group = comm.ulysses_group(dist.group.WORLD, degree)
    results = [run_case(rank, world, degree, ulysses_group, case) for case in cases]
    return results, sorted({call["name"] for call in module.calls})


@pytest.fixture(scope="module", params=SIZES, ids=lambda pu: f"P{pu[0]}-U{pu[1]}")
def matrix(request):
    world, degree = request.param
    per_rank = run_on_ranks(equivalence_worker, world, degree, CASES, timeout_s=600)
    for _, names in per_rank:
        assert names == ["npu_fusion_attention", "npu_fusion_attention_grad"], names
    return world, degree, [[r[0][i] for r in per_rank] for i in range(len(CASES))]


@pytest.fixture(scope="module")
def reference():
    return mla_reference()


def assemble(parts, lay, degree):
    """Every rank's result -> full-sequence tensors (kv_up_weight: summed over ranks)."""
    full = {k: layout.unshard([p[k] for p in parts], lay, ulysses_degree=degree)
            for k in ("out", "query", "kv_latent", "k_pos_emb")}
    full["kv_up_weight"] = sum(p["kv_up_weight"] for p in parts)
    return full


@pytest.mark.parametrize("index", range(len(CASES)), ids=lambda i: "-".join(CASES[i]))
def test_hybrid_matches_full_sequence_mla(matrix, reference, index):
    world, degree, results = matrix
    form, lay, kernel, _ = CASES[index]
    full = assemble(results[index], lay, degree)
    tol = tolerance(CASES[index])
    for name, expected in reference.items():
        got = full[name].double()
        err = ((got - expected).norm() / expected.norm()).item()
        assert err <= tol, f"{CASES[index]} P={world} U={degree}: {name} relative error {err}"


def _expected_traffic(form, world, degree, elem):
    """Payload bytes per (group, kind, direction), from the tensor shapes alone.

    s local tokens; an all-to-all's payload is its input, a gather's its
    shard, a reduce-scatter's its output (comm.py).
    """
    s = S // world
    q = s * B * N * (D_N + D_R) * elem            # local query, all heads
    o = s * B * N * D_V * elem                    # local output, all heads
    latent = s * B * (D_C + D_R) * elem           # [kv_latent, k_pos_emb] of the local tokens
    kv_heads = degree * s * B * (N // degree) * (D_N + D_R + D_V) * elem  # K+V after the all-to-all
    q_abs = s * B * N * (D_C + D_R) * elem
    if form == "laga":
        return {("ulysses", "all_to_all", "forward"): q + o, ("ulysses", "all_to_all", "backward"): q + o,
                ("cp", "all_gather", "forward"): latent, ("cp", "reduce_scatter", "backward"): latent}
    if form == "absorbed":
        return {("ulysses", "all_to_all", "forward"): q_abs + o,
                ("ulysses", "all_to_all", "backward"): q_abs + o,
                ("cp", "all_gather", "forward"): latent, ("cp", "reduce_scatter", "backward"): latent}
    kv_local = s * B * N * (D_N + D_R + D_V) * elem  # local K and V of every head, before the all-to-all
    return {("ulysses", "all_to_all", "forward"): q + kv_local + o,
            ("ulysses", "all_to_all", "backward"): q + kv_local + o,
            ("ring", "all_gather", "forward"): kv_heads, ("ring", "reduce_scatter", "backward"): kv_heads}


@pytest.mark.parametrize("index", [i for i, c in enumerate(CASES) if c[2] == "eager"],
                         ids=lambda i: "-".join(CASES[i]))
def test_hybrid_bytes_by_group(matrix, index):
    """LAGA: Q and O cross only the Ulysses group, only the latent the whole CP group."""
    world, degree, results = matrix
    form = CASES[index][0]
    expected = _expected_traffic(form, world, degree, elem=8)
    for rank, result in enumerate(results[index]):
        assert result["traffic"] == expected, (CASES[index], rank)
        sizes = result["group_sizes"]
        assert all(sizes[(g, k)] == {"ulysses": degree, "ring": world // degree, "cp": world}[g]
                   for g, k in sizes if k != "handshake")


# ---------------------------------------------------------------- layouts

def mindspeed_hybrid_zigzag(full, world, degree, rank):
    """The hybrid_cp_algo batch split as MindSpeed's data loader does it (dim 0 here)."""
    ring, u = divmod(rank, degree)
    r_size = world // degree
    chunks = full.view(2 * r_size, full.shape[0] // (2 * r_size), *full.shape[1:])
    pair = chunks.index_select(0, torch.tensor([ring, 2 * r_size - ring - 1]))
    return pair.reshape(-1, *full.shape[1:]).chunk(degree, dim=0)[u]


@pytest.mark.parametrize("world,degree,seq", [(4, 2, 16), (8, 2, 32), (8, 4, 32), (6, 3, 24),
                                              (4, 4, 8), (6, 2, 24)])
def test_layouts_match_the_host_split(world, degree, seq):
    full = torch.arange(seq)
    parts = [layout.shard(full, "zigzag", world, r, ulysses_degree=degree) for r in range(world)]
    for r, part in enumerate(parts):
        assert torch.equal(part, mindspeed_hybrid_zigzag(full, world, degree, r)), r
        assert torch.equal(layout.shard(full, "contiguous", world, r, ulysses_degree=degree),
                           full.chunk(world)[r])
    assert torch.equal(layout.unshard(parts, "zigzag", ulysses_degree=degree), full)
    s = seq // world
    for r in range(world):
        first = r - r % degree
        group_tokens = torch.cat(parts[first:first + degree])
        got = torch.cat([torch.arange(g, g + n) for _, n, g in
                         query_segments("zigzag", world, r, s, True, ulysses_degree=degree)])
        assert torch.equal(got, group_tokens)
        assert sum(n for _, n, _ in rank_segments("zigzag", world, r, s,
                                                  ulysses_degree=degree)) == s


def test_shard_rejects_a_sequence_the_hybrid_split_cannot_cut():
    with pytest.raises(ValueError, match=r"not divisible by 12 .*pad it to a multiple of 12"):
        layout.shard(torch.arange(18), "zigzag", 6, 0, ulysses_degree=3)
    with pytest.raises(ValueError, match="ulysses_degree=3 must be a positive divisor of CP=4"):
        layout.shard(torch.arange(16), "zigzag", 4, 0, ulysses_degree=3)


# ---------------------------------------------------------------- errors

def _call(rank, form="laga", heads=N, seq=S, cp_algo="hybrid", **kw):
    world = dist.get_world_size()
    x = shape_inputs(mla_shape(seq_len=seq // world, heads=heads), seed=7)  # this rank's part
    api.FORMS[form](*(x[k] for k in INPUTS), softmax_scale=SCALE, cp_group=dist.group.WORLD,
                    cp_algo=cp_algo, layout="zigzag", kernel="eager", **kw)


def error_worker(rank, world):
    pairs = comm.ulysses_group(dist.group.WORLD, 2)                               # {0,1}, {2,3}
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    whole = dist.new_group(list(range(world)))
    three = dist.new_group([0, 1, 2])
    single = [dist.new_group([r]) for r in range(world)][rank]
    mixed = pairs if rank < 2 else single                       # U=2 on ranks 0-1, U=1 on 2-3
    uneven = three if rank < 3 else single                      # U=3 on ranks 0-2, U=1 on 3
    cases = {
        "missing": dict(),
        "without_hybrid": dict(cp_algo="allgather", ulysses_group=pairs),
        "without_hybrid_ulysses": dict(cp_algo="ulysses", ulysses_group=pairs),
        "strided": dict(ulysses_group=strided),
        "not_a_group": dict(ulysses_group="ulysses"),
        "uneven": dict(ulysses_group=uneven),
        "heads": dict(ulysses_group=whole, heads=6),
        "disagree": dict(ulysses_group=mixed),
        "explicit_missing": dict(form="explicit"),
        "absorbed_strided": dict(form="absorbed", ulysses_group=strided),
    }
    return {name: outcome(_call, rank, **kw) for name, kw in cases.items()}


def odd_degree_worker(rank, world):
    whole = dist.new_group(list(range(world)))
    return outcome(_call, rank, seq=9, heads=3, ulysses_group=whole)


@pytest.fixture(scope="module")
def errors():
    return run_on_ranks(error_worker, 4, timeout_s=300)


EXPECTED_ERRORS = {
    "missing": {r: "cp_algo='hybrid' needs ulysses_group=" for r in range(4)},
    "without_hybrid": {r: "ulysses_group is given but cp_algo='allgather'" for r in range(4)},
    "without_hybrid_ulysses": {r: "ulysses_group is given but cp_algo='ulysses'" for r in range(4)},
    "strided": {r: "ulysses_group must be the 2 consecutive ranks of cp_group" for r in range(4)},
    "not_a_group": {r: "ulysses_group must be a torch.distributed process group" for r in range(4)},
    "uneven": {0: "ulysses_group has 3 ranks, which does not divide CP=4",
               1: "ulysses_group has 3 ranks, which does not divide CP=4",
               2: "ulysses_group has 3 ranks, which does not divide CP=4",
               3: "CP rank(s) [0, 1, 2] rejected their arguments"},
    "heads": {r: "6 heads (per TP rank) are not divisible by its size U=4" for r in range(4)},
    "disagree": {r: "CP ranks disagree on the size of ulysses_group: [2, 2, 1, 1]" for r in range(4)},
    "explicit_missing": {r: "cp_algo='hybrid' needs ulysses_group=" for r in range(4)},
    "absorbed_strided": {r: "ulysses_group must be the 2 consecutive ranks" for r in range(4)},
}


@pytest.mark.parametrize("name", EXPECTED_ERRORS)
def test_hybrid_errors_raise_on_every_rank_before_data_moves(errors, name):
    assert_raised_together([per_case[name] for per_case in errors], EXPECTED_ERRORS[name])


def test_hybrid_zigzag_sequence_the_split_cannot_cut():
    results = run_on_ranks(odd_degree_worker, 3, timeout_s=300)
    assert_raised_together(results, "needs the sequence divisible by 6")
    assert_raised_together(results, "pad the sequence to a multiple of 6")


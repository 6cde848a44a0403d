"""The third misuse round on two gloo ranks: arguments that used to escape the handshake
(a block size beyond int64, meta tensors on one rank), a gather handle started under
torch.no_grad(), byte-counter typos and a softmax_scale the kernels cannot represent.
Every rank must raise a ValueError naming the argument, the same text on every rank,
before any data collective; none may wait for a peer that has already failed.

All scenarios run in one spawned job, bounded by its timeout (the process-group
timeout is the same bound: a rank left waiting in a collective fails the job with
gloo's error instead of a ValueError). Each rank reports, per scenario, the exception
type, its message and the data bytes moved before it.
"""
from __future__ import annotations

import pytest
import torch

from mindspeed_laga import count_bytes, laga_attention, start_latent_gather
from mindspeed_laga import layout as layouts
from mindspeed_laga.tools.spawn import run_on_ranks
from support.raise_together import assert_raised_together, scenario_reports

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

S, B, N, D_N, D_R, D_V, D_C = 16, 1, 4, 8, 4, 8, 16
SCALE = (D_N + D_R) ** -0.5


def local_inputs(rank, world, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(S, B, N, D_N + D_R, generator=g), torch.randn(S, B, D_C, generator=g),
            torch.randn(S, B, D_R, generator=g)]
    out = [layouts.shard(t, "zigzag", world, rank) for t in full]
    out.append(torch.randn(N * (D_N + D_V), D_C, generator=g) * D_C ** -0.5)
    return [t.to(dtype=dtype, device=device).requires_grad_() for t in out]


def _group():
    import torch.distributed as dist
    return dist.group.WORLD


def _attend(rank, world, dtype=torch.float32, device="cpu", **kw):
    q, kv, kpe, w = local_inputs(rank, world, dtype, device)
    kw.setdefault("softmax_scale", SCALE)
    out = laga_attention(q, kv, kpe, w, cp_group=_group(), **kw)
    out.float().sum().backward()


def block_all(rank, world):
    _attend(rank, world, recompute_kv=True, kv_block_size=2 ** 63)


def block_one(rank, world):
    _attend(rank, world, recompute_kv=True, kv_block_size=(2 ** 64, 4)[rank])


def meta_one(rank, world):
    _attend(rank, world, device=("meta", "cpu")[rank], kernel="eager")


def gather_no_grad(rank, world):
    _, kv, kpe, _ = local_inputs(rank, world)
    with torch.no_grad():
        handle = start_latent_gather(kv, kpe, cp_group=_group())
    _attend_with(rank, world, handle, kv, kpe)


def _attend_with(rank, world, handle, kv, kpe):
    q, _, _, w = local_inputs(rank, world)
    out = laga_attention(q, kv, kpe, w, softmax_scale=SCALE, cp_group=_group(),
                         latent_gather=handle)
    out.sum().backward()


def counter_kind(rank, world):
    with count_bytes() as counter:
        _attend(rank, world)
    counter.bytes(kind="allgather")


def counter_direction(rank, world):
    with count_bytes() as counter:
        _attend(rank, world)
    counter.bytes(direction="fwd")


def tiny_scale(rank, world):
    _attend(rank, world, softmax_scale=1e-300)


def tiny_scale_bf16(rank, world):
    _attend(rank, world, dtype=torch.bfloat16, softmax_scale=1e-300)


def tiny_scale_one(rank, world):
    _attend(rank, world, softmax_scale=(1e-300, SCALE)[rank])


BLOCK = "kv_block_size must be a positive int below 2**63"
SCALE_RANGE = "softmax_scale must be between 1e-30 and 1e+30"
# the counter is read after a good call; the gather was started (and moved) before the call
MOVED_BEFORE = ("counter_kind", "counter_direction", "gather_no_grad")
SCENARIOS = {
    "block_all": (block_all, BLOCK),
    "block_one": (block_one, BLOCK),
    "meta_one": (meta_one, "on the meta device"),
    "gather_no_grad": (gather_no_grad, "latent_gather was started under torch.no_grad()"),
    "counter_kind": (counter_kind, "kind must be one of"),
    "counter_direction": (counter_direction, "direction must be one of"),
    "tiny_scale": (tiny_scale, SCALE_RANGE),
    "tiny_scale_bf16": (tiny_scale_bf16, SCALE_RANGE),
    "tiny_scale_one": (tiny_scale_one, SCALE_RANGE),
}


reports = scenario_reports(SCENARIOS)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_rank_raises_the_same_named_value_error(reports, name):
    assert_raised_together(reports[name], SCENARIOS[name][1], moved_data=name in MOVED_BEFORE)


# ---------------------------------------------------------------- float16 K/V overflow

TOKEN = 9  # its finite latent rebuilds to K/V beyond float16's range


def overflow_inputs():
    g = torch.Generator().manual_seed(0)
    x = [torch.randn(S, B, N, D_N + D_R, generator=g), torch.randn(S, B, D_C, generator=g),
         torch.randn(S, B, D_R, generator=g),
         torch.randn(N * (D_N + D_V), D_C, generator=g) * D_C ** -0.5]
    x[1][TOKEN] = 6e4  # finite in float16 (max 65504)
    x = [t.half() for t in x]
    rebuilt = torch.nn.functional.linear(x[1][TOKEN], x[3])
    assert torch.isfinite(x[1]).all() and torch.isinf(rebuilt).any()  # the premise
    return x


OVERFLOW_VARIANTS = {"laga": {}, "laga+recompute": {"recompute_kv": True},
                     "laga+blockwise": {"recompute_kv": True, "kv_block_size": 4}}


@pytest.mark.parametrize("kernel", ["eager", "auto"])
@pytest.mark.parametrize("variant", sorted(OVERFLOW_VARIANTS))
def test_rebuilt_kv_overflow_reaches_only_the_rows_that_attend_the_token(variant, kernel):
    x = overflow_inputs()
    out = laga_attention(*x, softmax_scale=SCALE, kernel=kernel, **OVERFLOW_VARIANTS[variant])
    finite = torch.isfinite(out[:, 0]).all(-1)
    assert finite.tolist() == [i < TOKEN for i in range(S)]  # causal: rows >= 9 see it
    clean = [t.clone() for t in x]
    clean[1][TOKEN] = 0  # invisible to the finite rows: they must not change
    ref = laga_attention(*clean, softmax_scale=SCALE, kernel=kernel, **OVERFLOW_VARIANTS[variant])
    torch.testing.assert_close(out[finite], ref[finite], rtol=0, atol=0)


def _overflow_worker(rank, world, cp_algo, options):
    x = overflow_inputs()
    local = [layouts.shard(t, "zigzag", world, rank) for t in x[:3]] + [x[3]]
    out = laga_attention(*local, softmax_scale=SCALE, cp_group=_group(), cp_algo=cp_algo,
                         kernel="eager", **options)
    positions = layouts.shard(torch.arange(S), "zigzag", world, rank)
    return positions.tolist(), torch.isfinite(out[:, 0]).all(-1).tolist()


# longer than run_on_ranks' own bound, so a hang is reported with the rank that hung
@pytest.mark.timeout(200)
@pytest.mark.parametrize("cp_algo, variant", [("allgather", "laga+recompute"),
                                              ("ulysses", "laga+blockwise")])
def test_rebuilt_kv_overflow_on_two_ranks(cp_algo, variant):
    for positions, finite in run_on_ranks(_overflow_worker, 2, cp_algo,
                                          OVERFLOW_VARIANTS[variant], timeout_s=120):
        assert finite == [p < TOKEN for p in positions], (positions, finite)

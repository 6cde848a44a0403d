"""torch.autocast around a form: it runs wholly in the autocast dtype and returns it,
exactly what the same call on inputs cast to that dtype returns (output and grads; the
grads of float32 inputs come back float32); float64 stays float64; the overlapped gather
casts alike, so its handle feeds the call. CPU autocast here; CUDA/NPU take the same path
(kernels/precision.autocast_dtype)."""
from __future__ import annotations

import pytest
import torch

from mindspeed_laga import (absorbed_attention, explicit_attention, laga_attention,
                            start_latent_gather)
from mindspeed_laga import layout as layouts
from mindspeed_laga.tools.spawn import run_on_ranks
from mindspeed_laga.tools.cases import INPUTS, MLAShape, full_inputs as shape_inputs

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

S, N, D_N, D_R, D_V, D_C = 16, 4, 8, 4, 8, 16
SCALE = (D_N + D_R) ** -0.5
VARIANTS = [(laga_attention, {}, "eager"), (laga_attention, {}, "sdpa"),
            (laga_attention, {"trim_causal_prefix": True}, "sdpa"),
            (laga_attention, {"recompute_kv": True}, "auto"),
            (laga_attention, {"recompute_kv": True, "kv_block_size": 4}, "eager"),
            (explicit_attention, {}, "eager"), (explicit_attention, {}, "sdpa"),
            (absorbed_attention, {}, "sdpa")]


SHAPE = MLAShape(seq_len=S, batch=1, heads=N, qk_head_dim=D_N, rope_dim=D_R, v_head_dim=D_V,
                 kv_lora_rank=D_C)


def inputs(dtype=torch.float32):
    x = shape_inputs(SHAPE, seed=0)
    return [x[k].to(dtype) for k in INPUTS]


def _grads(fn, tensors, options, kernel, autocast):
    leaves = [t.clone().requires_grad_() for t in tensors]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fn(*leaves, softmax_scale=SCALE, kernel=kernel, **options)
    out.float().sum().backward()  # backward outside the region, as torch recommends
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize("fn, options, kernel", VARIANTS,
                         ids=[f"{f.__name__}-{o}-{k}" for f, o, k in VARIANTS])
def test_autocast_runs_in_its_dtype_and_returns_it(fn, options, kernel):
    out, grads = _grads(fn, inputs(), options, kernel, autocast=True)
    ref, ref_grads = _grads(fn, [t.bfloat16() for t in inputs()], options, kernel, autocast=False)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    for got, want in zip(grads, ref_grads):
        assert got.dtype == torch.float32 and torch.equal(got, want.float())


def test_mixed_input_dtypes_under_autocast_are_one_dtype():
    """What an autocast model hands over: a bf16 query (from a linear), a float32 latent
    (from a norm) and a float32 weight."""
    x = inputs()
    x[0] = x[0].bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = laga_attention(*x, softmax_scale=SCALE)
    assert torch.equal(out, laga_attention(*[t.bfloat16() for t in x], softmax_scale=SCALE))


def test_float64_stays_float64_under_autocast():
    x = inputs(torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = laga_attention(*x, softmax_scale=SCALE, recompute_kv=True)
    assert out.dtype == torch.float64
    assert torch.equal(out, laga_attention(*x, softmax_scale=SCALE, recompute_kv=True))


def _overlap_worker(rank, world, autocast):
    import torch.distributed as dist
    x = [layouts.shard(t, "zigzag", world, rank) for t in inputs()[:3]] + [inputs()[3]]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        handle = start_latent_gather(x[1], x[2], cp_group=dist.group.WORLD)
        out = laga_attention(*x, softmax_scale=SCALE, cp_group=dist.group.WORLD,
                             latent_gather=handle)
    return out


@pytest.mark.timeout(120)
def test_the_overlapped_gather_casts_alike():
    plain = run_on_ranks(_overlap_worker, 2, False, timeout_s=60)
    cast = run_on_ranks(_overlap_worker, 2, True, timeout_s=60)
    for got, full in zip(cast, plain):
        assert got.dtype == torch.bfloat16 and full.dtype == torch.float32
        torch.testing.assert_close(got.float(), full, rtol=0.05, atol=0.02)

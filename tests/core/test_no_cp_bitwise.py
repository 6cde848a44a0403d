"""Without CP, LAGA and explicit run the same ops: bit-identical outputs and grads."""
import pytest
import torch

from mindspeed_laga import explicit_attention, laga_attention
from mindspeed_laga.tools.equivalence import INPUTS, MLAShape, full_inputs


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_laga_is_bit_identical_to_explicit_without_cp(kernel, dtype):
    shape = MLAShape(seq_len=48)
    full = full_inputs(shape, seed=7)
    results = []
    for fn in (explicit_attention, laga_attention):
        inputs = [full[k].to(dtype).requires_grad_() for k in INPUTS]
        out = fn(*inputs, softmax_scale=shape.softmax_scale, kernel=kernel)
        out.backward(full["grad_out"].to(dtype))
        results.append([out.detach()] + [t.grad for t in inputs])
    for name, a, b in zip(("out",) + INPUTS, *results):
        assert torch.equal(a, b), f"{name} differs (max {(a.double() - b.double()).abs().max()})"


def _latent_grad_worker(rank, world, recompute, overlap):
    import torch.distributed as dist
    from mindspeed_laga import start_latent_gather
    from mindspeed_laga.layout import shard
    shape = MLAShape(seq_len=16)
    full = full_inputs(shape, seed=5)
    leaves = [shard(full[k], "zigzag", world, rank).float().requires_grad_() if k != "kv_up_weight"
              else full[k].float() for k in INPUTS]
    args = [t * 1 if t.requires_grad else t for t in leaves]  # non-leaf: grads arrive as produced
    seen = []
    for t in args[1:3]:
        t.register_hook(lambda g: seen.append(g.is_contiguous()))
    gather = start_latent_gather(args[1], args[2], cp_group=dist.group.WORLD) if overlap else None
    out = laga_attention(*args, softmax_scale=0.2, cp_group=dist.group.WORLD, kernel="eager",
                         recompute_kv=recompute, latent_gather=gather)
    out.sum().backward()
    return seen


@pytest.mark.parametrize("recompute,overlap", [(False, False), (True, False), (False, True)])
def test_latent_grads_leave_contiguous(recompute, overlap):
    """Megatron's TP copy region skips its all-reduce on strided grads (see forms/common.py)."""
    from mindspeed_laga.tools.spawn import run_on_ranks
    for flags in run_on_ranks(_latent_grad_worker, 2, recompute, overlap):
        assert flags == [True, True]

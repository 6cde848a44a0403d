"""Without CP, LAGA and explicit run the same ops: bit-identical outputs and grads."""
import pytest
import torch

from mindspeed_laga import explicit_attention, laga_attention
from mindspeed_laga.equivalence import INPUTS, MLAShape, full_inputs


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

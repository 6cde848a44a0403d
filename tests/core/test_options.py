"""LAGA's options beyond the paper (recompute, blockwise rebuild, causal prefix
trimming, overlapped gather), each on and all together, against the float64
single-device reference: output and all four grads, for both cp_algos, both
layouts and CP sizes 1, 2, 4, 8. Tolerances as in test_equivalence."""
import itertools

import pytest

from mindspeed_laga.tools import equivalence as eq

from support.references import assert_matches_reference, case_id, cp_matrix
from support.variants import CPU_KERNELS, PLAIN_ALGOS

SHAPE = eq.MLAShape(seq_len=64)
ALL_ON = (("recompute_kv", True), ("kv_block_size", 8), ("trim_causal_prefix", True), ("overlap", True))
OPTION_SETS = {
    "trim": ((("trim_causal_prefix", True),), CPU_KERNELS),
    "recompute": ((("recompute_kv", True),), ("eager",)),
    "blockwise": ((("recompute_kv", True), ("kv_block_size", 8)), ("eager",)),
    "blockwise-uneven": ((("recompute_kv", True), ("kv_block_size", 7)), ("eager",)),
    "overlap": ((("overlap", True),), CPU_KERNELS),
    "all": (ALL_ON, ("eager",)),
}
CASES = [eq.Case(form="laga", cp_algo=a, layout=l, kernel=k, dtype=d, shape=SHAPE, options=opts)
         for (opts, kernels), a, l, d in itertools.product(
             OPTION_SETS.values(), PLAIN_ALGOS, ("zigzag", "contiguous"),
             ("float32", "bfloat16"))
         for k in kernels]
CASES += [eq.Case(form="laga", kernel="eager", causal=False, shape=SHAPE, options=ALL_ON, cp_algo=a)
          for a in PLAIN_ALGOS]


matrix = cp_matrix(CASES)  # one spawn per CP size (1, 2, 4, 8)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_option_matches_single_device_reference(matrix, case):
    assert_matches_reference(matrix[case], case)


def test_eager_block_kernel_head_chunks_match_one_chunk(monkeypatch):
    """Chunking heads to bound the transient scores changes nothing."""
    import torch
    from mindspeed_laga.kernels import eager as bk
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 5, 8, generator=g), torch.randn(2, 6, 7, 8, generator=g),
               torch.randn(2, 6, 7, 4, generator=g))
    offset = 2  # key j visible to row i iff j <= i + 2
    d_out = torch.randn(2, 6, 5, 4, generator=g)
    whole = bk.EagerBlock.forward(q, k, v, offset, 0.3)
    whole_grads = bk.EagerBlock.backward(q, k, v, offset, 0.3, d_out, *whole)
    monkeypatch.setattr(bk, "SCORE_CHUNK_ELEMENTS", 2 * 5 * 7 * 4)  # 4 heads, then 2
    assert len(bk._head_chunks(q, k)) == 2
    chunked = bk.EagerBlock.forward(q, k, v, offset, 0.3)
    chunked_grads = bk.EagerBlock.backward(q, k, v, offset, 0.3, d_out, *whole)
    for a, b in zip(whole + whole_grads, chunked + chunked_grads):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)

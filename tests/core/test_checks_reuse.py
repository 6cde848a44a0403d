"""A call like one that passed reuses what its checks found (``checks.check``), so only
what the checks read may decide a reuse: an option equal to a valid one by ``==`` but
invalid itself (``1`` for ``True``), or a tensor of another shape, is checked in full and
raises."""
import re

import pytest
import torch

from mindspeed_laga import checks, laga_attention
from mindspeed_laga.tools.equivalence import INPUTS, MLAShape, full_inputs

SHAPE = MLAShape(seq_len=16, heads=4)


def inputs(**override):
    full = full_inputs(SHAPE, seed=3)
    args = {k: full[k].float() for k in INPUTS}
    args.update(override)
    return [args[k] for k in INPUTS]


@pytest.mark.parametrize("valid, invalid, words", [
    ({"causal": True}, {"causal": 1}, "causal must be True or False"),
    ({"check_ranks": True}, {"check_ranks": 1}, "check_ranks must be True, False or None"),
    ({"pad_v": False}, {"pad_v": 0}, "pad_v must be True or False"),
    ({"softmax_scale": 1}, {"softmax_scale": True}, "softmax_scale must be a positive"),
    ({"trim_causal_prefix": False}, {"trim_causal_prefix": 0}, "trim_causal_prefix must be"),
    ({"cu_seqlens": (0, 1, 16)}, {"cu_seqlens": (0, True, 16)}, "cu_seqlens must hold"),
], ids=["causal", "check_ranks", "pad_v", "softmax_scale", "trim", "cu_seqlens"])
def test_an_option_equal_to_a_passed_one_is_still_checked(valid, invalid, words):
    x = inputs(query=inputs()[0][:, :1], kv_latent=inputs()[1][:, :1],
               k_pos_emb=inputs()[2][:, :1])  # micro-batch 1: cu_seqlens allows it
    kw = {"softmax_scale": SHAPE.softmax_scale, **valid}
    first = laga_attention(*x, **kw)
    again = laga_attention(*x, **kw)  # reuses the first call's checks
    assert torch.equal(first, again)
    with pytest.raises(ValueError, match=re.escape(words)):
        laga_attention(*x, **{**kw, **invalid})


def test_a_tensor_of_another_shape_is_checked_in_full():
    laga_attention(*inputs(), softmax_scale=SHAPE.softmax_scale)
    assert checks._SEEN_WITHOUT_CP  # what the call found is kept
    with pytest.raises(ValueError, match="kv_up_weight has 130 rows"):
        laga_attention(*inputs(kv_up_weight=torch.zeros(130, 32)),
                       softmax_scale=SHAPE.softmax_scale)

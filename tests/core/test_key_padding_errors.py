"""What key padding refuses, by name, and on every CP rank alike (the handshake)."""
from __future__ import annotations

import pytest
import torch

from mindspeed_laga import laga_attention
from mindspeed_laga.tools.spawn import run_on_ranks
from support.key_padding import S, SCALE, full_inputs, local_inputs, padding_mask


def _call(**kwargs):
    x = full_inputs()
    args = [x[k] for k in ("query", "kv_latent", "k_pos_emb", "kv_up_weight")]
    return laga_attention(*args, softmax_scale=SCALE, **kwargs)


BAD = {
    "not bool": (dict(key_padding_mask=padding_mask("right").long()), "bool tensor"),
    "local length": (dict(key_padding_mask=padding_mask("right")[:, :16]), "[2, 32]"),
    "one sample": (dict(key_padding_mask=padding_mask("right")[:1]), "[2, 32]"),
    "empty_rows": (dict(key_padding_mask=padding_mask("left"), empty_rows="nan"), "empty_rows"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_key_padding_mask_is_named(name):
    kwargs, needle = BAD[name]
    with pytest.raises(ValueError, match="key_padding_mask|empty_rows") as info:
        _call(**kwargs)
    assert needle in str(info.value)


def test_documents_with_key_padding_are_refused():
    x = full_inputs(batch=1)
    args = [x[k] for k in ("query", "kv_latent", "k_pos_emb", "kv_up_weight")]
    with pytest.raises(ValueError, match="key_padding_mask with cu_seqlens"):
        laga_attention(*args, softmax_scale=SCALE, cu_seqlens=[0, 10, 32],
                       key_padding_mask=padding_mask("right")[:1])


# padding a linear checksum (per row, the sum of 2*col+1 over padded keys) could not tell
# apart: rank 0 {0,1,2,3} and {1,2}, rank 1 {3,4} and {0,3} (16 and 8 on both); and masks
# with the same pad counts at other positions ({1,2} and {0,3}: the counts cannot show it)
COLLIDING = {0: ((0, 1, 2, 3), (1, 2)), 1: ((3, 4), (0, 3))}
SAME_COUNTS = {0: ((1, 2), (1, 2)), 1: ((0, 3), (1, 2))}
CASES = {"other padding": "[[7, 3], [7, 4]]", "no mask on one rank": "key_padding_mask",
         "colliding checksums": "[[4, 2], [2, 2]]",
         "same counts elsewhere": "which keys are padding"}


def padding_at(columns) -> torch.Tensor:
    """[len(columns), S] bool: sample i pads the keys ``columns[i]``."""
    mask = torch.zeros(len(columns), S, dtype=torch.bool)
    for i, cols in enumerate(columns):
        mask[i, list(cols)] = True
    return mask


def _worker(rank, cp, cases):
    import torch.distributed as dist
    x = full_inputs()
    inputs, _ = local_inputs(x, "zigzag", cp, rank)
    errors = []
    for case in cases:
        mask = padding_mask("left")
        if rank == 1 and case == "other padding":
            mask = padding_mask("left", pads=(7, 4))
        if rank == 1 and case == "no mask on one rank":
            mask = None
        if case == "colliding checksums":
            mask = padding_at(COLLIDING[rank])
        if case == "same counts elsewhere":
            mask = padding_at(SAME_COUNTS[rank])
        try:
            laga_attention(*inputs.values(), x["kv_up_weight"], softmax_scale=SCALE,
                           cp_group=dist.group.WORLD, key_padding_mask=mask, check_ranks=True)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.timeout(300)
def test_ranks_with_other_padding_raise_together():
    per_rank = run_on_ranks(_worker, 2, list(CASES), timeout_s=120)
    for i, (case, needle) in enumerate(CASES.items()):
        first, second = per_rank[0][i], per_rank[1][i]
        assert first and first == second and needle in first, (case, first, second)

"""The second misuse round on two gloo ranks: each scenario makes the ranks differ (or one
rank fail) in a way that used to abort, hang or run wrong, and every rank must raise a
ValueError naming the argument before any data collective.

All scenarios run in one spawned job, bounded by its timeout (the process-group
timeout is the same bound, so a rank left waiting in a collective fails the job
with gloo's error instead of a ValueError). Each rank reports, per scenario, the
exception type, its message and the data bytes moved before it.
"""
from __future__ import annotations

import math

import pytest
import torch

from mindspeed_laga import (agreement, count_bytes, explicit_attention, laga_attention,
                            start_latent_gather)
from mindspeed_laga import layout as layouts
from mindspeed_laga.tools.spawn import run_on_ranks
from mindspeed_laga.tools.cases import INPUTS, MLAShape, full_inputs as shape_inputs
from support.raise_together import assert_raised_together, outcome, scenario_reports

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

S, B, N, D_N, D_R, D_V, D_C = 16, 1, 4, 8, 4, 8, 16
SCALE = (D_N + D_R) ** -0.5


SHAPE = MLAShape(seq_len=S, batch=B, heads=N, qk_head_dim=D_N, rope_dim=D_R, v_head_dim=D_V,
                 kv_lora_rank=D_C)


def local_inputs(rank, world, grads=(True, True, True, True), dtype=torch.float32):
    full = shape_inputs(SHAPE, seed=0)
    out = [layouts.shard(full[k], "zigzag", world, rank).to(dtype) for k in INPUTS[:3]]
    out.append(full["kv_up_weight"].to(dtype))
    return [t.requires_grad_(grad) for t, grad in zip(out, grads)]


def _group():
    import torch.distributed as dist
    return dist.group.WORLD


def _attend(rank, world, form=laga_attention, grads=(True,) * 4, **kw):
    q, kv, kpe, w = local_inputs(rank, world, grads)
    kw.setdefault("softmax_scale", SCALE)
    kw.setdefault("cp_group", _group())
    out = form(q, kv, kpe, w, kernel="eager", **kw)
    if out.requires_grad:
        out.sum().backward()


def gather_dtype(rank, world):
    _, kv, kpe, _ = local_inputs(rank, world, dtype=(torch.float32, torch.bfloat16)[rank])
    start_latent_gather(kv, kpe, cp_group=_group())


def gather_grads(rank, world):
    _, kv, kpe, _ = local_inputs(rank, world, grads=(True, rank == 0, rank == 0, True))
    start_latent_gather(kv, kpe, cp_group=_group())


# rank 0: only the query needs a gradient; rank 1: only the latent
SPLIT_GRADS = ((True, False, False, False), (False, True, True, False))


def grads_ulysses(rank, world):
    _attend(rank, world, grads=SPLIT_GRADS[rank], cp_algo="ulysses")


def grads_explicit(rank, world):
    _attend(rank, world, form=explicit_attention, grads=SPLIT_GRADS[rank])


def _on_rank0(rank, bad, good):
    return bad if rank == 0 else good


def cu_seqlens_inf(rank, world):
    _attend(rank, world, cu_seqlens=_on_rank0(rank, [0, math.inf, 16], [0, 8, 16]))


def cu_seqlens_meta(rank, world):
    bounds = torch.tensor([0, 8, 16], device=_on_rank0(rank, "meta", "cpu"))
    _attend(rank, world, cu_seqlens=bounds)


def huge_scale(rank, world):
    _attend(rank, world, softmax_scale=_on_rank0(rank, 10 ** 400, SCALE))


class _Unreadable:
    """Boundaries whose reading fails with an error type no check foresaw."""

    def __iter__(self):
        raise RuntimeError("this cu_seqlens cannot be read")


def unforeseen_error(rank, world):
    _attend(rank, world, cu_seqlens=_on_rank0(rank, _Unreadable(), [0, 8, 16]))


def float8(rank, world):
    q, kv, kpe, w = (t.detach().to(torch.float8_e4m3fn) for t in local_inputs(rank, world))
    laga_attention(q, kv, kpe, w, softmax_scale=SCALE, cp_group=_group())


def cp_group_str(rank, world):
    _attend(rank, world, cp_group="WORLD")


def cp_group_int(rank, world):
    _attend(rank, world, cp_group=0)


def cp_group_list(rank, world):
    _attend(rank, world, cp_group=[0, 1])


def documents_differ(rank, world):
    _attend(rank, world, cu_seqlens=([0, 8, 16], [0, 4, 16])[rank])


def skip_exchanges(rank, world):
    """Both ranks agree to skip (the setup of the next scenario)."""
    _attend(rank, world, check_ranks=False)
    _attend(rank, world, check_ranks=False)  # every rank passed False: skipping from now on
    assert agreement.skips(_group())


def check_ranks_after_skip(rank, world):
    """An explicit check_ranks=True exchanges again, although the group skips."""
    _attend(rank, world, check_ranks=True, causal=(True, False)[rank])


SCENARIOS = {
    "gather_dtype": (gather_dtype, "disagree on the dtype: ['torch.float32', 'torch.bfloat16']"),
    "gather_grads": (gather_grads, "disagree on which inputs need grads (requires_grad under "
                                   "grad mode): [['kv_latent', 'k_pos_emb'], []]"),
    "grads_ulysses": (grads_ulysses, "disagree on which inputs need grads (requires_grad under "
                                     "grad mode): [['query'], ['kv_latent', 'k_pos_emb']]"),
    "grads_explicit": (grads_explicit, "[['query'], ['kv_latent', 'k_pos_emb']]"),
    "cu_seqlens_inf": (cu_seqlens_inf, ("cu_seqlens must hold finite integer document "
                                        "boundaries", "CP rank(s) [0] rejected")),
    "cu_seqlens_meta": (cu_seqlens_meta, ("cu_seqlens is a meta tensor",
                                          "CP rank(s) [0] rejected")),
    "huge_scale": (huge_scale, ("softmax_scale must be a positive, finite real number",
                                "CP rank(s) [0] rejected")),
    "float8": (float8, "inputs of dtype torch.float8_e4m3fn are not supported"),
    "cp_group_str": (cp_group_str, "cp_group must be a torch.distributed process group"),
    "cp_group_int": (cp_group_int, "cp_group must be a torch.distributed process group"),
    "cp_group_list": (cp_group_list, "cp_group must be a torch.distributed process group"),
    "documents_differ": (documents_differ, "disagree on documents (cu_seqlens): "
                                           "[[0, 8, 16], [0, 4, 16]] (by rank)"),
    "check_ranks_after_skip": (check_ranks_after_skip, "disagree on causal: [True, False]"),
}


SETUP = {"check_ranks_after_skip": skip_exchanges}


def _unforeseen_worker(rank, world):
    return outcome(unforeseen_error, rank, world)


def _membership_worker(rank, world):
    """Each rank passes the one-rank group of the other rank."""
    import torch.distributed as dist
    groups = [dist.new_group([r]) for r in range(world)]  # collective: every rank builds both
    return outcome(lambda r, w: _attend(r, w, cp_group=groups[1 - r]), rank, world)


reports = scenario_reports(SCENARIOS, SETUP)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_rank_raises_a_named_value_error(reports, name):
    assert_raised_together(reports[name], SCENARIOS[name][1])


@pytest.mark.timeout(120)
def test_an_unforeseen_local_error_reaches_the_peers():
    """The failing rank re-raises its own exception; its peer hears of it in the exchange."""
    (kind0, text0, _), (kind1, text1, bytes1) = run_on_ranks(_unforeseen_worker, 2, timeout_s=60)
    assert (kind0, text0) == ("RuntimeError", "this cu_seqlens cannot be read")
    assert kind1 == "ValueError" and "CP rank(s) [0] rejected" in text1 and bytes1 == 0


@pytest.mark.timeout(120)
def test_a_group_this_rank_is_not_in_is_named():
    for rank, (kind, text, _) in enumerate(run_on_ranks(_membership_worker, 2, timeout_s=60)):
        assert kind == "ValueError", (rank, kind, text)
        assert f"cp_group: this process (global rank {rank}) is not a member" in text


def _same_weight_worker(rank, world, differ):
    import torch.distributed as dist
    weight = torch.randn(N * (D_N + D_V), D_C, generator=torch.Generator().manual_seed(0))
    if differ and rank == 1:
        weight[3, 5] = torch.nextafter(weight[3, 5], torch.tensor(2.0))  # one ulp, one element
    try:
        agreement.check_same_weight(weight.to(torch.bfloat16 if differ == "bf16" else weight.dtype),
                                    dist.group.WORLD)
        return None
    except ValueError as exc:
        return str(exc)


@pytest.mark.timeout(120)
def test_kv_up_weight_that_differs_by_one_ulp_is_caught_on_every_rank():
    assert run_on_ranks(_same_weight_worker, 2, False, timeout_s=60) == [None, None]
    for text in run_on_ranks(_same_weight_worker, 2, True, timeout_s=60):
        assert text is not None and "kv_up_weight differs between CP ranks: CP rank(s) [1]" in text


def test_weight_checksum_sees_swapped_rows_and_single_bits():
    w = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    base = agreement.weight_checksum(w)
    assert agreement.weight_checksum(w.clone()) == base
    assert agreement.weight_checksum(w[[1, 0] + list(range(2, 64))]) != base
    flipped = w.clone()
    flipped.view(torch.int32)[7, 3] ^= 1  # the lowest mantissa bit
    assert agreement.weight_checksum(flipped) != base
    assert agreement.weight_checksum(w.to(torch.bfloat16)) != base


def _skip_policy_worker(rank, world):
    """The first call exchanges (every rank passes False: the group skips from then on);
    then None (the default) skips, an explicit True exchanges once (and the group keeps
    skipping), False skips."""
    agreement.reset()
    kinds = []
    for check in (False, False, None, True, None, False):
        with count_bytes() as counter:
            _attend(rank, world, check_ranks=check)
        kinds.append(sum(r.kind == "handshake" for r in counter.records))
    return kinds


@pytest.mark.timeout(120)
def test_explicit_check_ranks_true_exchanges_although_the_group_skips():
    for kinds in run_on_ranks(_skip_policy_worker, 2, timeout_s=60):
        assert kinds == [1, 0, 0, 1, 0, 0]


@pytest.mark.parametrize("group", ["WORLD", 0, [0, 1]])
def test_start_latent_gather_checks_cp_group_too(group):
    _, kv, kpe, _ = local_inputs(0, 1)
    with pytest.raises(ValueError, match="cp_group must be a torch.distributed process group"):
        start_latent_gather(kv, kpe, cp_group=group)

"""Sparse MLA with given picks (``topk_indices``: GLM-5.2's layers that reuse an earlier
layer's top-k) under CP: a computing layer, then a reusing one over the same tokens.

Both equal the float64 reference of tests/support/sparse_mla.py (the reusing one with the
reference's picks given: no indexer, no loss, no index-input grads); the reusing layer
returns the picks it was given; the byte counter sees [kv_latent | k_pos_emb | index_key]
gathered for the computing layer and [kv_latent | k_pos_emb] for the reusing one (704 and
576 values per token at GLM-5.2's dims), each reduce-scattered once backward; wrong picks
are refused by name, and ranks that disagree on them raise together before any gather.
"""
import pytest
import torch

from mindspeed_laga import agreement
from mindspeed_laga.sparse.form import sparse_laga_attention
from mindspeed_laga.tools.spawn import run_on_ranks
from support import sparse_given_picks as gp
from support import sparse_mla as sm

# GLM-5.2's gathered dims (kv_lora_rank 512, rope 64, index head dim 128), small otherwise
GLM52 = dict(D_C=512, D_R=64, INDEX_DIM=128, S=16, B=1, HEADS=2, D_N=8, D_V=8, INDEX_HEADS=2)
ATOL = {"index_query": 1e-6, "index_key": 1e-6, "index_weights": 1e-6}


def _close(name, got, want):
    scale = want.abs().max().item()
    assert scale > 0, f"{name}: the reference is all zero"
    assert (got - want).abs().max().item() <= ATOL.get(name, 1e-10) * max(1.0, scale), name


def _assemble(per_rank, layer, layout):
    runs = [ranks[0][layer] for ranks in per_rank]
    seq = [r["output"] for r in runs]
    grads = {k: sm.layouts.unshard([r["grads"][k] for r in runs], layout)
             for k in runs[0]["grads"] if k != "kv_up_weight"}
    grads["kv_up_weight"] = sum(r["grads"]["kv_up_weight"] for r in runs)
    return dict(output=sm.layouts.unshard(seq, layout), grads=grads,
                topk_indices=sm.layouts.unshard([r["topk_indices"] for r in runs], layout, dim=1),
                loss=None if runs[0]["loss"] is None else sum(r["loss"] for r in runs) / len(runs))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("cp_size,layout,dims,micro_batch",
                         [(2, "contiguous", None, False), (4, "zigzag", GLM52, False),
                          (2, "zigzag", None, True)],
                         ids=["cp2-contiguous", "cp4-zigzag-glm52-dims", "cp2-one-micro-batch"])
def test_reusing_layer_equals_the_reference(cp_size, layout, dims, micro_batch):
    """In one micro-batch the reusing layer is a later call, its narrower gather a new kind
    there: it meets its peers with a stand-in first, every rank moved alike, nothing raises."""
    per_rank = run_on_ranks(gp.chain_worker, cp_size, layout, 0, dims, micro_batch,
                            timeout_s=150)
    computing = sm.reference(sm.full_inputs(0, dims=dims))
    reusing = sm.reference(sm.full_inputs(1, dims=dims), picks=computing["topk_indices"])
    for layer, want in ((0, computing), (1, reusing)):
        got = _assemble(per_rank, layer, layout)
        assert torch.equal(got["topk_indices"], computing["topk_indices"]), layer
        _close("output", got["output"], want["output"])
        assert got["grads"].keys() == {k for k, g in want["grads"].items() if g is not None}
        for name, grad in got["grads"].items():
            _close(name, grad, want["grads"][name])
    assert _assemble(per_rank, 1, layout)["loss"] is None
    loss = _assemble(per_rank, 0, layout)["loss"].item()
    assert abs(loss - computing["loss"].item()) <= 1e-6 * abs(computing["loss"].item())
    _check_bytes(per_rank, cp_size, dims or {}, micro_batch)


def _check_bytes(per_rank, cp_size, dims, micro_batch=False):
    """The computing layer gathers d_c + d_r + D values per token, the reusing one d_c + d_r
    (at GLM-5.2's dims: 704 and 576); each is reduce-scattered once backward."""
    d = {**dict(S=sm.S, B=sm.B, D_C=sm.D_C, D_R=sm.D_R, INDEX_DIM=sm.INDEX_DIM), **dims}
    tokens = d["S"] // cp_size * d["B"]
    widths = (d["D_C"] + d["D_R"] + d["INDEX_DIM"], d["D_C"] + d["D_R"])
    if dims == GLM52:
        assert widths == (704, 576)
    row = ("handshake", "forward", len(agreement.FIELDS) * 8)
    for (layers, backward) in per_rank:
        for call, (layer, width) in enumerate(zip(layers, widths)):
            exchanged = [row] if call == 0 or not micro_batch else []  # a later call: none
            # a micro-batch's first gather of a new kind first meets the peers with a stand-in
            # of the exchanged call's shape (the peers may still gather that one), then moves
            met = [("all_gather", "forward", widths[0] * tokens * 8)] if call and micro_batch \
                else []
            assert layer["records"] == exchanged + met + [("all_gather", "forward",
                                                           width * tokens * 8)]
        assert sorted(backward) == sorted(("reduce_scatter", "backward", w * tokens * 8)
                                          for w in widths), backward


def _args(x):
    return [x[k] for k in sm.LOCAL[:3]] + [x["kv_up_weight"]]


KW = dict(index_topk=sm.TOPK, softmax_scale=sm.SCALE, qk_head_dim=sm.D_N, v_head_dim=sm.D_V)


def test_given_picks_are_checked_by_name():
    x = sm.full_inputs(0)
    picks = torch.zeros(sm.B, sm.S, sm.TOPK, dtype=torch.long)
    none = [None] * 3
    cases = [(picks.float(), "int32 or int64"), (picks[0], r"\[b, s, k\]"),
             (picks[:, :-1], r"\[2, 16, k\]"), (torch.zeros(sm.B, sm.S, sm.TOPK + 1).long(),
                                                "index_topk=5")]
    for bad, message in cases:
        with pytest.raises(ValueError, match="topk_indices.*" + message):
            sparse_laga_attention(*_args(x), *none, **KW, topk_indices=bad)
    with pytest.raises(ValueError, match="pass None for index_query, index_key"):
        sparse_laga_attention(*_args(x), *(x[k] for k in sm.LOCAL[3:]), **KW,
                              topk_indices=picks)
    with pytest.raises(ValueError, match="indexer_loss_coeff=None"):
        sparse_laga_attention(*_args(x), *none, **KW, indexer_loss_coeff=sm.COEFF,
                              topk_indices=picks)


def disagreeing_worker(rank, world_size):
    """Rank 0 gives picks, rank 1 runs the indexer: the message, and the data collectives."""
    import torch.distributed as dist

    from mindspeed_laga import count_bytes, layout as layouts
    x = {k: layouts.shard(v, "contiguous", world_size, rank) if k != "kv_up_weight" else v
         for k, v in sm.full_inputs(0).items()}
    index = [None] * 3 if rank == 0 else [x[k] for k in sm.LOCAL[3:]]
    picks = torch.zeros(sm.B, sm.S // world_size, sm.TOPK, dtype=torch.long)
    with count_bytes() as counter:
        try:
            sparse_laga_attention(*_args(x), *index, **KW, cp_group=dist.group.WORLD,
                                  layout="contiguous", topk_indices=picks if rank == 0 else None)
            message = None
        except ValueError as exc:
            message = str(exc)
    return message, [r.kind for r in counter.records if r.kind != "handshake"]


@pytest.mark.timeout(200)
def test_ranks_that_disagree_on_given_picks_raise_before_the_gather():
    for message, data in run_on_ranks(disagreeing_worker, 2, timeout_s=120):
        assert message is not None and "topk_indices" in message and data == [], message


# ------------------------------------------------------- given picks checked on the device

HALF = sm.S // 2  # rank 1 holds positions HALF.. under the contiguous layout
BAD = {  # name -> (rank 1's local row, a pick put there, or None: the whole row -1)
    "beyond the sequence": (0, sm.S),
    "a row of only -1": (1, None),
    "past the query's position": (2, HALF + 3),
}


def bad_picks_worker(rank, world_size):
    """Per case, one micro-batch: a computing layer, then a reusing one whose picks rank 1
    corrupts (no IndexError, no exchange in that call), then settle: what each raised, and
    the reusing layer's output."""
    import torch.distributed as dist

    from mindspeed_laga import layout as layouts, new_micro_batch, settle
    group, reports = dist.group.WORLD, {}
    for name, (row, pick) in BAD.items():
        agreement.reset()
        dist.barrier()
        new_micro_batch(group)
        x, y = sm.full_inputs(0), sm.full_inputs(1)
        local = {k: layouts.shard(x[k], "contiguous", world_size, rank) for k in sm.LOCAL}
        first = sparse_laga_attention(*_args({**local, "kv_up_weight": x["kv_up_weight"]}),
                                      *(local[k] for k in sm.LOCAL[3:]), **KW,
                                      cp_group=group, layout="contiguous")
        picks = first.topk_indices.clone()
        if rank == 1:
            picks[0, row] = -1 if pick is None else picks[0, row]
            if pick is not None:
                picks[0, row, 0] = pick
        reused = {k: layouts.shard(y[k], "contiguous", world_size, rank) for k in sm.LOCAL[:3]}
        try:
            out = sparse_laga_attention(*_args({**reused, "kv_up_weight": y["kv_up_weight"]}),
                                        *[None] * 3, **KW, cp_group=group, layout="contiguous",
                                        topk_indices=picks).output
            later = None
        except Exception as exc:  # noqa: BLE001 -- the kind is what is checked
            out, later = None, f"{type(exc).__name__}: {exc}"
        try:
            settle()
            settled = None
        except ValueError as exc:
            settled = str(exc)
        reports[name] = (later, settled, out, first.topk_indices)
    return reports


@pytest.mark.timeout(200)
def test_wrong_given_picks_poison_their_rows_and_raise_at_settle_on_every_rank():
    per_rank = run_on_ranks(bad_picks_worker, 2, timeout_s=150)
    for name, (row, _) in BAD.items():
        picks = torch.cat([per_rank[r][name][3] for r in range(2)], dim=1)
        want = sm.reference(sm.full_inputs(1), picks=picks)["output"]
        for rank in range(2):
            later, settled, out, _ = per_rank[rank][name]
            assert later is None, (name, rank, later)  # the later call itself ran
            assert settled and "CP rank(s) [1]: topk_indices" in settled, (name, rank, settled)
            expected = want[rank * HALF:(rank + 1) * HALF].clone()
            if rank == 1:
                assert torch.isnan(out[row, 0]).all(), name  # the wrong row is poisoned
                expected[row, 0] = out[row, 0]
            assert torch.allclose(out, expected, atol=1e-10, rtol=0, equal_nan=True), (name, rank)


def test_wrong_given_picks_raise_by_name_without_cp():
    x = sm.full_inputs(0)
    picks = sparse_laga_attention(*_args(x), *(x[k] for k in sm.LOCAL[3:]), **KW).topk_indices
    for row, pick in BAD.values():
        bad = picks.clone()
        bad[0, row + HALF] = -1
        if pick is not None:
            bad[0, row + HALF, 0] = pick  # global positions: the same rows as on rank 1
        with pytest.raises(ValueError, match="topk_indices held picks no query may attend"):
            sparse_laga_attention(*_args(x), *[None] * 3, **KW, topk_indices=bad)


# ------------------------------------------- picks on one rank, the indexer on the other, later

def _layer(rank, world_size, seed, picks=None):
    """One sparse layer call on this rank's contiguous shard of inputs ``seed``: the
    indexer's (``picks`` None) or a reusing one; forward only."""
    import torch.distributed as dist

    from mindspeed_laga import layout as layouts
    x = sm.full_inputs(seed)
    local = {k: layouts.shard(x[k], "contiguous", world_size, rank) for k in sm.LOCAL}
    index = [local[k] for k in sm.LOCAL[3:]] if picks is None else [None] * 3
    return sparse_laga_attention(*_args({**local, "kv_up_weight": x["kv_up_weight"]}), *index,
                                 **KW, cp_group=dist.group.WORLD, layout="contiguous",
                                 topk_indices=picks)


def switched_kind_worker(rank, world_size, switched_in):
    """Two micro-batches of a computing layer and a reusing one; in micro-batch
    ``switched_in`` rank 1 runs the indexer in the reusing layer's place (a wider gather
    than its peer's): what each call and settle gave."""
    from mindspeed_laga import new_micro_batch, settle
    import torch.distributed as dist
    group, report = dist.group.WORLD, {}
    for micro_batch in (1, 2):
        new_micro_batch(group)
        first = _layer(rank, world_size, 0)
        switched = micro_batch == switched_in and rank == 1
        try:
            report[micro_batch] = _layer(rank, world_size, 1,
                                         None if switched else first.topk_indices).output
        except ValueError as exc:
            report[micro_batch] = str(exc)
        try:
            settle()
            report[f"settle {micro_batch}"] = None
        except ValueError as exc:
            report[f"settle {micro_batch}"] = str(exc)
        report[f"picks {micro_batch}"] = first.topk_indices
    return report


@pytest.mark.timeout(200)
@pytest.mark.parametrize("switched_in", [1, 2], ids=["first-micro-batch", "after-one"])
def test_a_rank_that_switches_to_the_indexer_in_a_later_call_joins_and_is_named(switched_in):
    """A later call's gather is expected to hold what the call at its place held in the
    previous micro-batch, else (the first micro-batch) what the last of its kind or the
    exchanged call held: the rank whose gather differs sends a stand-in of that shape and
    raises naming it; its peer's call returns NaN (no abort) and its settle names the cause.
    The other micro-batch equals the float64 reference on both ranks."""
    per_rank = run_on_ranks(switched_kind_worker, 2, switched_in, timeout_s=150)
    right = 3 - switched_in
    picks = torch.cat([r[f"picks {right}"] for r in per_rank], dim=1)
    want = sm.reference(sm.full_inputs(1), picks=picks)["output"]
    for rank, report in enumerate(per_rank):
        assert report[f"settle {right}"] is None, report[f"settle {right}"]
        assert torch.allclose(report[right], want[rank * HALF:(rank + 1) * HALF], atol=1e-10,
                              rtol=0)
        settled = report[f"settle {switched_in}"]
        assert settled and "latent's shape" in settled, settled
    named = [r[switched_in] for r in per_rank if isinstance(r[switched_in], str)]
    nan = [r[switched_in] for r in per_rank if not isinstance(r[switched_in], str)]
    assert len(named) == 1 and "latent's shape" in named[0], named
    assert len(nan) == 1 and torch.isnan(nan[0]).all()

"""Every bad input raises a ValueError naming the argument and the fix, before any
data collective; ranks that disagree raise together instead of hanging."""
import pytest
import torch
import torch.distributed as dist

from mindspeed_laga import count_bytes, explicit_attention, laga_attention, absorbed_attention, layout
from mindspeed_laga.tools.equivalence import INPUTS, MLAShape, full_inputs
from mindspeed_laga.tools.spawn import run_on_ranks
from support.raise_together import assert_raised_together, outcome

SHAPE = MLAShape(seq_len=16, heads=4)
FORMS = (laga_attention, explicit_attention, absorbed_attention)


def inputs(**override):
    full = full_inputs(SHAPE, seed=3)
    args = {k: full[k].float() for k in INPUTS}
    args.update(override)
    return [args[k] for k in INPUTS]


def call(fn, args, **kw):
    kw.setdefault("softmax_scale", SHAPE.softmax_scale)
    return fn(*args, **kw)


BAD_ARGS = [
    ("query dims", dict(query=torch.zeros(16, 2, 24)), {}, "query must have 4 dims"),
    ("latent seq", dict(kv_latent=torch.zeros(15, 2, 32)), {}, "must share [s, b]"),
    ("rope batch", dict(k_pos_emb=torch.zeros(16, 3, 8)), {}, "must share [s, b]"),
    ("rope too wide", dict(k_pos_emb=torch.zeros(16, 2, 24)), {}, "qk_pos_emb_head_dim"),
    ("weight cols", dict(kv_up_weight=torch.zeros(128, 31)), {}, "kv_up_weight must be"),
    ("weight rows", dict(kv_up_weight=torch.zeros(130, 32)), {}, "kv_up_weight has 130 rows"),
    ("dtype", dict(kv_latent=torch.zeros(16, 2, 32, dtype=torch.float64)), {}, "share one dtype"),
    ("integer", dict(query=torch.zeros(16, 2, 4, 24, dtype=torch.int64),
                     kv_latent=torch.zeros(16, 2, 32, dtype=torch.int64),
                     k_pos_emb=torch.zeros(16, 2, 8, dtype=torch.int64),
                     kv_up_weight=torch.zeros(128, 32, dtype=torch.int64)), {}, "floating point"),
    ("float8", dict(query=torch.zeros(16, 2, 4, 24, dtype=torch.float8_e4m3fn),
                    kv_latent=torch.zeros(16, 2, 32, dtype=torch.float8_e4m3fn),
                    k_pos_emb=torch.zeros(16, 2, 8, dtype=torch.float8_e4m3fn),
                    kv_up_weight=torch.zeros(128, 32, dtype=torch.float8_e4m3fn)), {},
     "inputs of dtype torch.float8_e4m3fn are not supported"),
    ("cp_group", {}, dict(cp_group="WORLD"), "cp_group must be a torch.distributed process group"),
    ("check_ranks", {}, dict(check_ranks=0), "check_ranks must be True, False or None"),
    ("scale 10**400", {}, dict(softmax_scale=10 ** 400), "softmax_scale must be a positive"),
    ("cp_algo", {}, dict(cp_algo="ring"), "cp_algo='ring' is unknown"),
    ("layout", {}, dict(layout="striped"), "layout='striped' is unknown"),
    ("kernel", {}, dict(kernel="flash"), "kernel='flash' is unknown"),
    ("causal", {}, dict(causal="yes"), "causal must be True or False"),
    ("scale", {}, dict(softmax_scale=-1.0), "softmax_scale must be a positive"),
]


@pytest.mark.parametrize("fn", FORMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("name,override,kw,message", BAD_ARGS, ids=[b[0] for b in BAD_ARGS])
def test_bad_argument_names_itself(fn, name, override, kw, message):
    with count_bytes() as counter, pytest.raises(ValueError) as err:
        call(fn, inputs(**override), **kw)
    assert message in str(err.value)
    assert counter.records == []


def test_npu_kernel_without_torch_npu(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", None)
    with pytest.raises(ValueError, match="kernel='npu' needs torch_npu"):
        call(laga_attention, inputs(), kernel="npu")


@pytest.mark.parametrize("layout_name,length,message", [
    ("zigzag", 20, "not divisible by 8 (2*CP"), ("contiguous", 18, "not divisible by 4 (CP")])
def test_sequence_not_divisible_when_sharding(layout_name, length, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("*", r"\*")):
        layout.shard(torch.zeros(length, 2), layout_name, 4, 0)


# ------------------------------------------------------------- multi-rank errors

def _bad_call(rank, world, problem):
    """Each rank passes what ``problem`` says."""
    s = {"odd_zigzag": 5, "lengths_differ": 4 + 2 * rank, "one_rank_odd": 4 + rank}[problem]
    full = full_inputs(MLAShape(seq_len=s, heads=4), seed=1)
    laga_attention(*[full[k].float() for k in INPUTS], softmax_scale=0.1, cp_group=dist.group.WORLD)


def _bad_worker(rank, world, problem):
    return outcome(_bad_call, rank, world, problem)


@pytest.mark.parametrize("problem,messages", [
    ("odd_zigzag", ["needs the sequence divisible by 2*CP=4"] * 2),
    ("lengths_differ", ["CP ranks disagree on the local sequence length: [4, 6]"] * 2),
    ("one_rank_odd", ["CP rank(s) [1] rejected their arguments", "divisible by 2*CP=4"]),
])
def test_ranks_raise_together(problem, messages):
    assert_raised_together(run_on_ranks(_bad_worker, 2, problem, timeout_s=60), messages)


def _heads_worker(rank, world):
    full = full_inputs(MLAShape(seq_len=8, heads=3), seed=1)
    try:
        laga_attention(*[full[k].float() for k in INPUTS], softmax_scale=0.1,
                       cp_group=dist.group.WORLD, cp_algo="ulysses")
    except ValueError as exc:
        return str(exc)


def test_ulysses_heads_not_divisible():
    for text in run_on_ranks(_heads_worker, 2, timeout_s=60):
        assert "3 heads are not divisible by CP=2" in text and "cp_algo='allgather'" in text


# ------------------------------------------------------------- LAGA option errors

OPTION_ERRORS = [
    (dict(kv_block_size=8), "kv_block_size needs recompute_kv=True"),
    (dict(recompute_kv=True, kv_block_size=0), "kv_block_size must be a positive int"),
    (dict(recompute_kv=True, kv_block_size=2.5), "kv_block_size must be a positive int"),
    (dict(recompute_kv="yes"), "recompute_kv must be True or False"),
    (dict(trim_causal_prefix=1), "trim_causal_prefix must be True or False"),
    (dict(latent_gather=object()), "latent_gather must come from start_latent_gather"),
]


@pytest.mark.parametrize("kw,message", OPTION_ERRORS, ids=[m for _, m in OPTION_ERRORS])
def test_bad_laga_option_names_itself(kw, message):
    with count_bytes() as counter, pytest.raises(ValueError) as err:
        call(laga_attention, inputs(), **kw)
    assert message in str(err.value)
    assert counter.records == []


def test_start_latent_gather_needs_cp():
    from mindspeed_laga import start_latent_gather
    args = inputs()
    with pytest.raises(ValueError, match="needs cp_group of size > 1"):
        start_latent_gather(args[1], args[2], cp_group=None)


def _gather_misuse_worker(rank, world, misuse):
    from mindspeed_laga import start_latent_gather
    full = full_inputs(MLAShape(seq_len=8, heads=4), seed=1)
    args = [full[k].float() for k in INPUTS]
    gather = start_latent_gather(args[1], args[2], cp_group=dist.group.WORLD)
    kw = dict(softmax_scale=0.1, cp_group=dist.group.WORLD, latent_gather=gather)
    try:
        if misuse == "other_tensors":
            laga_attention(args[0], args[1].clone(), args[2], args[3], **kw)
        else:  # a handle feeds one call
            laga_attention(*args, **kw)
            laga_attention(*args, **kw)
    except ValueError as exc:
        return str(exc)


@pytest.mark.parametrize("misuse,message", [
    ("other_tensors", "started on other kv_latent/k_pos_emb tensors"),
    ("reused", "a LatentGather feeds one laga_attention call")])
def test_latent_gather_misuse(misuse, message):
    for text in run_on_ranks(_gather_misuse_worker, 2, misuse, timeout_s=60):
        assert text is not None and message in text, text

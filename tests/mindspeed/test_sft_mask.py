"""MindSpeed-LLM's SFT attention mask through the adapter (patches/attention_mask.py) and
the start-up check of --no-pad-to-seq-lengths.

The masks are built as MindSpeed-LLM's ``get_tune_attention_mask`` builds them (True =
masked: ``~(tril & key_valid)``); the real function, the real class at CP 2 against the
unpatched one at CP 1 and the real trainer's batches are exercised in
tests/support/mindspeed_llm_real.py (the ``sft-*`` cases)."""
from __future__ import annotations

import pytest
import torch

from mindspeed_laga.patches.attention_mask import key_padding_from_mask
from mindspeed_laga.tools.spawn import run_on_ranks
from support.laga_parser import parse
from mindspeed_laga.features import LAGAFeature

pytestmark = pytest.mark.ascend  # the leg that runs it (tests/conftest.py)

S, B = 16, 2


@pytest.fixture(autouse=True)
def rows_in_blocks(monkeypatch):
    """The mask is compared a block of rows at a time: blocks of 5 rows cut these 16."""
    from mindspeed_laga.patches import attention_mask
    monkeypatch.setattr(attention_mask, "ROWS_PER_CHECK", 5)


def tune_mask(valid_1d: torch.Tensor) -> torch.Tensor:
    """get_tune_attention_mask's result for a [b, S] 1/0 token mask: [b, 1, S, S]."""
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    return ~(causal & valid_1d.bool()[:, None, :])[:, None]


def valid(side, pads=(3, 6)):
    mask = torch.ones(B, S, dtype=torch.long)
    for i, n in enumerate(pads):
        if side == "right":
            mask[i, S - n:] = 0
        else:
            mask[i, :n] = 0
    return mask


@pytest.mark.parametrize("side", ["right", "left"])
def test_the_sft_mask_becomes_its_key_padding(side):
    tokens = valid(side)
    got = key_padding_from_mask(tune_mask(tokens), S, B, None)
    assert torch.equal(got, tokens == 0)


@pytest.mark.parametrize("how", ["in place", ".data", "numpy"])
def test_a_mask_edited_after_its_first_read_is_read_again(how):
    """The verdict is kept per mask; an edit that bumps no version counter (``.data``, a
    numpy view) must not leave the old padding in place."""
    mask = tune_mask(valid("right"))
    assert torch.equal(key_padding_from_mask(mask, S, B, None), valid("right") == 0)
    edited = tune_mask(valid("left"))
    if how == "in place":
        mask.copy_(edited)
    elif how == ".data":
        mask.data.copy_(edited)
    else:
        mask.numpy()[...] = edited.numpy()
    assert torch.equal(key_padding_from_mask(mask, S, B, None), valid("left") == 0)


@pytest.mark.parametrize("how", [".data", "numpy"])
def test_a_middle_row_edited_after_the_first_read_is_refused(how):
    """An edit in a row other than the last (the padding is read from the last) that bumps
    no version counter: the verdict is not kept past a micro-batch (none here: every call
    reads the mask), so the band it makes is refused, not run as the old padding."""
    mask = tune_mask(valid("right"))
    assert torch.equal(key_padding_from_mask(mask, S, B, None), valid("right") == 0)
    if how == ".data":
        mask.data[:, :, 5, 0] = True
    else:
        mask.numpy()[:, :, 5, 0] = True
    with pytest.raises(ValueError, match="not the causal mask plus key padding"):
        key_padding_from_mask(mask, S, B, None)


def test_a_causal_mask_takes_the_fast_path():
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)
    assert key_padding_from_mask(causal[None, None], S, B, None) is None
    assert key_padding_from_mask(causal[None, None].expand(B, 1, S, S), S, B, None) is None
    compressed = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    assert key_padding_from_mask(compressed, S, B, None) is None
    assert key_padding_from_mask(None, S, B, None) is None


def _band():
    mask = tune_mask(valid("right")).clone()
    mask[:, :, 10, 0] = True  # a key before the query masked: a band, not padding
    return mask


REFUSED = {
    "band": (_band, "not the causal mask plus key padding"),
    "query padding": (lambda: tune_mask(valid("right")) | (valid("right") == 0)[:, None, :, None],
                      "not the causal mask plus key padding"),
    "split by CP": (lambda: tune_mask(valid("right"))[:, :, :S // 2], "[b, 1, S, S]"),
    "float": (lambda: tune_mask(valid("left")).float(), "torch.float32"),
    "compressed, not causal": (lambda: torch.zeros(2048, 2048, dtype=torch.bool),
                               "compressed causal mask"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_mask_laga_cannot_express_is_refused_by_name(name):
    build, needle = REFUSED[name]
    with pytest.raises(ValueError, match="--mla-latent-all-gather") as info:
        key_padding_from_mask(build(), S, B, None)
    assert needle in str(info.value)


def test_a_batch_length_the_cp_split_cannot_take_names_the_flags():
    def length_error(n):
        return None if n % 4 == 0 else f"{n} needs --pad-to-multiple-of"
    mask = torch.ones(1, 1, 18, 18, dtype=torch.bool).triu(1)
    with pytest.raises(ValueError, match="18 needs --pad-to-multiple-of"):
        key_padding_from_mask(mask, 18, 1, None, length_error)


def _layer_call(mask, group, rank):
    """What the adapter does per layer call: read the mask, then the core (which carries the
    padding, or this rank's refusal, to every rank before any data moves)."""
    from mindspeed_laga import comm, count_bytes, laga_attention
    g = torch.Generator().manual_seed(0)
    heads, d_n, d_r, d_c = 2, 4, 2, 8
    s = S // 2
    query = torch.randn(s, B, heads, d_n + d_r, generator=g, dtype=torch.float64)
    latent = torch.randn(s, B, d_c, generator=g, dtype=torch.float64)
    k_pe = torch.randn(s, B, d_r, generator=g, dtype=torch.float64)
    weight = torch.randn(heads * 2 * d_n, d_c, generator=g, dtype=torch.float64)
    with count_bytes() as counter:
        try:
            padding = key_padding_from_mask(mask, S, B, group)
            laga_attention(query, latent, k_pe, weight, softmax_scale=0.5, cp_group=group,
                           layout="contiguous", key_padding_mask=padding)
        except ValueError as exc:
            return str(exc), counter.bytes()
    return None, counter.bytes()


def _ranks_worker(rank, world, case):
    import torch.distributed as dist
    tokens = valid("left")
    if case == "one rank's mask differs" and rank == 1:
        tokens = valid("left", pads=(3, 5))
    mask = tune_mask(tokens)
    if case == "one rank's mask is refused" and rank == 1:
        mask = _band()
    return _layer_call(mask, dist.group.WORLD, rank)


@pytest.mark.timeout(300)
def test_ranks_raise_together_before_any_data_moves():
    for case, needle in (("one rank's mask differs", "key_padding_mask (which keys are padding; "
                          "shown: padding keys per sample): [[3, 6], [3, 5]]"),
                         ("one rank's mask is refused", "rejected their arguments")):
        results = run_on_ranks(_ranks_worker, 2, case, timeout_s=120)
        (error0, moved0), (error1, moved1) = results
        assert error0 and needle in error0, (case, results)
        assert error1, (case, results)
        assert moved0 == moved1 == 0, (case, results)  # no data collective ran


START = ["--multi-latent-attention", "--disable-bias-linear", "--attention-dropout", "0.0",
         "--num-attention-heads", "8", "--seq-length", "64", "--context-parallel-size", "2",
         "--mla-latent-all-gather", "--no-pad-to-seq-lengths"]


@pytest.mark.parametrize("algo,pad_to,ok", [
    ("megatron_cp_algo", 8, True), ("megatron_cp_algo", 6, False),
    ("ulysses_cp_algo", 6, True), ("ulysses_cp_algo", 3, False)])
def test_no_pad_to_seq_lengths_needs_a_splittable_multiple(algo, pad_to, ok):
    feature = LAGAFeature()
    args = parse(START + ["--context-parallel-algo", algo, "--pad-to-multiple-of", str(pad_to)],
                 feature)
    if ok:
        feature.validate_args(args)
        return
    with pytest.raises(ValueError) as info:
        feature.validate_args(args)
    message = str(info.value)
    for needle in ("--no-pad-to-seq-lengths", f"--pad-to-multiple-of {pad_to}",
                   "--mla-latent-all-gather"):
        assert needle in message

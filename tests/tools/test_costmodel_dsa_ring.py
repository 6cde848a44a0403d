"""The ring/hybrid question for sparse MLA, in numbers: the cost model's three ways to
serve DSA under a ring or hybrid split, each figure against one derived by hand from
DeepSeek-V3.2's dims, and the refusal that carries the answer."""
from __future__ import annotations

import pytest
from support.laga_parser import parse

from mindspeed_laga.features import LAGAFeature
from mindspeed_laga.tools.costmodel import dsa, dsa_ring

MiB = 2 ** 20


def test_128k_cp16_the_gather_the_ring_and_hybrid():
    t = dsa_ring.ring_alternatives(*dsa.dsa_preset("deepseek-v3.2"), 131072, 16, 2, 8)["paths"]
    tokens, keys, bf16 = 131072 // 16, 512 + 64 + 128, 2
    chunk = tokens * keys * bf16                                   # 11 MiB
    assert chunk == 11 * MiB
    laga, ring, hybrid = t["laga"], t["ring"], t["hybrid"]
    # LAGA: 704 gathered and reduce-scattered, 15 other ranks' shards each way
    assert laga["received_bytes"] == 2 * 15 * chunk == 330 * MiB
    assert laga["peak_key_bytes"] == 2 * 131072 * keys * bf16 == 352 * MiB
    # the ring: index keys then latent + rope forward (704), keys and their grads backward
    assert (ring["values_per_token_forward"], ring["values_per_token_backward"]) == (704, 1408)
    assert ring["received_bytes"] == 3 * 15 * chunk == 495 * MiB
    assert ring["peak_key_bytes"] == 4 * chunk == 44 * MiB and ring["steps"] == 60
    # hybrid: each head's query (128 x 192) and output (128 x 128), 7/8 of them leave the rank
    heads = 128 * 192 + 128 * 128
    assert hybrid["values_per_token_forward"] == 704 + heads * 7 // 8 == 36544
    assert hybrid["received_bytes"] == ring["received_bytes"] + 2 * tokens * heads * 7 // 8 * bf16
    # the answer: the ring saves memory, never bytes; hybrid moves ~50x the gather's values
    assert ring["received_bytes"] > laga["received_bytes"] < hybrid["received_bytes"]
    assert hybrid["values_per_token_forward"] > 50 * laga["values_per_token_forward"]


@pytest.mark.parametrize("algo", ["megatron_cp_algo", "hybrid_cp_algo"])
def test_the_refusal_says_why_and_names_the_split_that_runs(algo):
    argv = ["--multi-latent-attention", "--disable-bias-linear", "--attention-dropout", "0.0",
            "--num-attention-heads", "8", "--seq-length", "64", "--context-parallel-size", "4",
            "--enable-dsa-indexer", "--context-parallel-algo", algo, "--ulysses-degree-in-cp", "2",
            "--mla-latent-all-gather"]
    feature = LAGAFeature()
    args = parse(argv, feature)
    with pytest.raises(ValueError) as info:
        feature.validate_args(args)
    message = str(info.value)
    assert f"--context-parallel-algo {algo}" in message
    assert "1.5x the bytes" in message and "use --context-parallel-algo kvallgather_cp_algo" in message

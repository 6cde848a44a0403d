"""Steady state of the megatron-core patch in training: per MLA layer call, only its data
collectives and no host read.

megatron-core's tiny MLA GPT (mindspeed_laga.tools.megatron_cpu, 3 layers) trained 3 SGD
steps at CP = 2 through megatron's DDP, as test_megatron_e2e.py trains it, with the
collective and host-sync counters (tests/support/collectives.py, host_syncs.py) open over
LAGA's code only (tests/support/laga_regions.py): each patched forward call, filed by step
and layer, and LAGA's autograd backward functions, filed by step. The loss, the gradient
reduction and the optimizer are the host's and not counted. From the second step on
(every module past its first, warm-up call):

- the step's first layer call may exchange the ranks' agreement, once (one small int64
  all-gather), beside its data collectives;
- every later layer call: exactly its data collectives forward (allgather: the latent's
  all-gather; ulysses adds the all-to-alls of Q and O) and no host read;
- the backward: each layer's adjoint collectives (the reduce-scatter; ulysses' all-to-alls)
  and no host read.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from mindspeed_laga.tools.spawn import run_on_ranks  # noqa: E402

pytestmark = pytest.mark.mcore

LAYERS, STEPS = 3, 3
CASES = {  # name: (patch arguments, batch layout)
    "allgather": (dict(cp_algo="allgather"), "zigzag"),
    "allgather+recompute_kv+overlap": (dict(cp_algo="allgather", recompute_kv=True,
                                            kv_block_size=8, overlap_latent_gather=True),
                                       "zigzag"),
    "ulysses": (dict(cp_algo="ulysses", layout="contiguous"), "contiguous"),
}


def _counted_training(patch, layout):
    import warnings

    import mindspeed_laga
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from mindspeed_laga.tools import megatron_cpu as mc
    from support.collectives import count_collectives
    from support.host_syncs import count_host_syncs
    from support.laga_regions import backward_regions

    tiny = mc.TinyMLA(num_layers=LAYERS)
    mindspeed_laga.patch_megatron_mla(**patch)
    model = mc.build_tiny_mla_gpt(tiny, cp=2)
    patched = MLASelfAttention.forward
    calls = [0]

    def step():
        return (calls[0] - 1) // LAYERS

    with count_host_syncs(everywhere=False) as syncs, count_collectives(regions=syncs) as seen:
        def forward(self, *args, **kwargs):
            if torch._C._current_autograd_node() is not None:  # a recompute, inside backward
                region = f"recompute.{step()}"
            else:
                calls[0] += 1
                region = f"forward.{step()}.{(calls[0] - 1) % LAYERS}"
            with syncs.region(region):
                return patched(self, *args, **kwargs)

        MLASelfAttention.forward = forward
        try:
            with backward_regions(syncs, lambda: f"backward.{step()}"), \
                    warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mc.train(model, mc.make_batches(tiny, STEPS), layout=layout)
        finally:
            MLASelfAttention.forward = patched
            mindspeed_laga.unpatch_megatron_mla()
    assert calls[0] == LAYERS * STEPS, calls
    regions = {c.region for c in seen.calls} | set(syncs.by_region())
    return {region: dict(collectives=[(c.kind, str(c.dtype).replace("torch.", ""))
                                      for c in seen.select(region)],
                         syncs=syncs.by_op(region))
            for region in regions if region is not None}


def worker(rank, world_size, names):
    from mindspeed_laga.tools import megatron_cpu as mc
    out = {}
    for name in names:
        mc.init_parallel(cp=world_size)
        out[name] = _counted_training(*CASES[name])
    return out


@pytest.fixture(scope="module")
def counted():
    return run_on_ranks(worker, 2, list(CASES), timeout_s=600)


def _data(cp_algo):
    forward, backward = ["all_gather"], ["reduce_scatter"]
    if cp_algo == "ulysses":
        forward, backward = forward + ["all_to_all"] * 2, backward + ["all_to_all"] * 2
    return sorted(forward), sorted(backward)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(CASES))
def test_steady_state_in_training(counted, name):
    forward, backward = _data(CASES[name][0]["cp_algo"])
    for rank, results in enumerate(counted):
        counts = results[name]
        for step in range(1, STEPS):
            where = f"{name}, rank {rank}, step {step}: {counts}"
            first = counts[f"forward.{step}.0"]
            exchanges = [c for c in first["collectives"] if c[1] == "int64"]
            assert len(exchanges) <= 1, where
            assert sorted(k for k, dtype in first["collectives"] if dtype != "int64") == \
                forward, where
            for layer in range(1, LAYERS):
                call = counts[f"forward.{step}.{layer}"]
                assert sorted(k for k, _ in call["collectives"]) == forward, (layer, where)
                assert "int64" not in {dtype for _, dtype in call["collectives"]}, (layer, where)
                assert call["syncs"] == {}, (layer, where)
            back = counts.get(f"backward.{step}", dict(collectives=[], syncs={}))
            assert sorted(k for k, _ in back["collectives"]) == sorted(backward * LAYERS), where
            assert back["syncs"] == {}, where
            assert f"recompute.{step}" not in counts, where

"""A CP rank whose kv_up_weight differs from its peers' (one element, one ulp) is caught on
the patched module's first call, on every rank, before it trains on wrong K/V; the same
weights train as before. Real megatron-core on two gloo ranks."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
from mindspeed_laga.tools import megatron_cpu as mc  # noqa: E402

from mindspeed_laga.tools.spawn import run_on_ranks  # noqa: E402

pytestmark = pytest.mark.mcore  # the leg that runs it (tests/conftest.py)


def _worker(rank, world, differ):
    import mindspeed_laga
    from mindspeed_laga import count_bytes
    mc.init_parallel(cp=world)
    mindspeed_laga.patch_megatron_mla(cp_algo="allgather")
    tiny = mc.TinyMLA()
    model = mc.build_tiny_mla_gpt(tiny, cp=world)
    weights = [p for name, p in model.named_parameters()
               if name.endswith("linear_kv_up_proj.weight")]
    if differ and rank == 1:
        with torch.no_grad():
            w = weights[-1]  # the last layer: the first layers' calls pass
            w[2, 3] = torch.nextafter(w[2, 3], torch.tensor(9.0))
    try:
        with count_bytes() as counter:
            mc.train(model, mc.make_batches(tiny, 2))
    except ValueError as exc:
        return str(exc)
    finally:
        mindspeed_laga.unpatch_megatron_mla()
    return [r.kind for r in counter.records].count("handshake"), len(weights)


@pytest.mark.timeout(300)
def test_a_rank_with_other_kv_up_weight_raises_on_every_rank():
    for text in run_on_ranks(_worker, 2, True, timeout_s=240):
        assert isinstance(text, str) and "kv_up_weight differs between CP ranks: CP rank(s) [1]" \
            in text, text


@pytest.mark.timeout(300)
def test_equal_weights_pay_one_checksum_exchange_per_module():
    for handshakes, layers in run_on_ranks(_worker, 2, False, timeout_s=240):
        # per module's first call: the weight checksum and the shape exchange; the second
        # step opens a micro-batch (one exchange, on its first layer call; the others fold),
        # and each optimizer step after it settles (one more)
        assert handshakes == 2 * layers + 2, (handshakes, layers)

"""The collective counter (tests/support/collectives.py) sees every collective exactly once.

On 2 gloo ranks: each ``torch.distributed`` collective, called by name, through an alias
taken before the count opened and through one built on another (``all_gather_object``), is
one record of the right kind and payload; LAGA's call is its handshake (a small int64
all-reduce, which ``comm.count_bytes`` files apart) plus the data collectives that
``comm.count_bytes`` records, the same kinds and payloads in the same order.
"""
import pytest
import torch
import torch.distributed as dist
from torch.distributed import all_reduce as aliased_all_reduce

from mindspeed_laga import count_bytes, laga_attention
from mindspeed_laga.tools.spawn import run_on_ranks
from support import key_padding as kp
from support.collectives import comm_data, count_collectives

pytestmark = pytest.mark.ascend  # the loops count with it on the Ascend stack


def _direct_calls(rank, world_size):
    x = torch.arange(4, dtype=torch.float32) + rank
    original = dist.all_reduce
    out = {}
    with count_collectives() as calls:
        dist.all_reduce(x.clone())
        aliased_all_reduce(x.clone())  # bound before the count opened
        dist.broadcast(x.clone(), src=0)
        dist.all_gather([torch.empty_like(x) for _ in range(world_size)], x)
        dist.all_gather_into_tensor(torch.empty(world_size * 4), x)
        dist.reduce_scatter_tensor(torch.empty(2), x)
        dist.all_to_all_single(torch.empty_like(x), x)
        dist.all_gather_object([None] * world_size, {"rank": rank})
        dist.barrier()
    out["calls"] = [(c.name, c.kind, c.payload, c.group_size) for c in calls.calls]
    out["restored"] = dist.all_reduce is original and aliased_all_reduce is original
    return out


def test_every_collective_is_one_record():
    per_rank = run_on_ranks(_direct_calls, 2, timeout_s=120)
    f32 = 4
    for got in per_rank:
        assert got["calls"] == [
            ("all_reduce", "all_reduce", 4 * f32, 2),
            ("all_reduce", "all_reduce", 4 * f32, 2),
            ("broadcast", "broadcast", 4 * f32, 2),
            ("all_gather", "all_gather", 4 * f32, 2),
            ("all_gather_into_tensor", "all_gather", 4 * f32, 2),
            ("reduce_scatter_tensor", "reduce_scatter", 2 * f32, 2),
            ("all_to_all_single", "all_to_all", 4 * f32, 2),
            ("all_gather_object", "all_gather_object", 0, 2),  # not its inner all_gathers
            ("barrier", "barrier", 0, 2),
        ]
        assert got["restored"]


def _laga_call(rank, world_size):
    x = kp.full_inputs()
    inputs, local = kp.local_inputs(x, "zigzag", world_size, rank)
    weight = x["kv_up_weight"].clone().requires_grad_()
    with count_collectives() as calls, count_bytes() as counter:
        out = laga_attention(inputs["query"], inputs["kv_latent"], inputs["k_pos_emb"], weight,
                             softmax_scale=kp.SCALE, cp_group=dist.group.WORLD, layout="zigzag")
        out.backward(local(x["grad_out"]))
    return dict(seen=calls.data(), comm=comm_data(counter), data_bytes=counter.bytes(),
                handshake_bytes=counter.bytes(kind="handshake"),
                phases=[(c.kind, c.backward, c.dtype) for c in calls.calls])


def test_laga_call_handshake_is_a_collective_and_data_agrees_with_comm():
    per_rank = run_on_ranks(_laga_call, 2, timeout_s=180)
    f64 = 8
    local_tokens = kp.S // 2 * kp.B
    latent = local_tokens * (kp.D_C + kp.D_R) * f64
    for got in per_rank:
        assert got["seen"] == got["comm"]
        assert got["handshake_bytes"] > 0
        # the handshake: one int64 all-reduce before the latent's, counted as a collective
        assert got["phases"] == [("all_reduce", False, torch.int64),
                                 ("all_gather", False, torch.float64),
                                 ("reduce_scatter", True, torch.float64)]
        assert [p for k, p in got["seen"]][1:] == [latent, latent]
        assert got["data_bytes"] == 2 * latent  # comm's data total leaves the handshake out

"""What the cross-rank handshake costs per call, beside the attention call it guards.

    python scripts/dev/handshake_cost.py [--cp 4] [--seq-len 1024] [--calls 20]

On P spawned gloo ranks: times LAGA's forward+backward with ``check_ranks``
forcing the exchange on every call, and again after every rank agreed on
``check_ranks=False`` (the group then skips it), and the exchange alone. Prints
per-call milliseconds (median over calls, slowest rank) and the exchange's bytes.
Also the adapters' first-call weight check (``agreement.check_same_weight``) on a
bfloat16 ``kv_up_weight`` of DeepSeek-V3's size at TP=1 (``--weight-rows`` 128
heads x (128 + 128), ``--kv-lora-rank`` 512): the checksum, and checksum plus
exchange.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def _worker(rank, world, seq_len, calls, weight_shape):
    import torch.distributed as dist

    from mindspeed_laga import agreement, count_bytes, laga_attention
    from mindspeed_laga import layout as layouts

    g = torch.Generator().manual_seed(0)
    heads, d_n, d_r, d_v, d_c = 16, 16, 8, 16, 64
    full = [torch.randn(seq_len, 1, heads, d_n + d_r, generator=g),
            torch.randn(seq_len, 1, d_c, generator=g), torch.randn(seq_len, 1, d_r, generator=g)]
    local = [layouts.shard(t, "zigzag", world, rank).requires_grad_() for t in full]
    weight = (torch.randn(heads * (d_n + d_v), d_c, generator=g) / d_c ** 0.5).requires_grad_()

    def step(check):
        out = laga_attention(*local, weight, softmax_scale=(d_n + d_r) ** -0.5,
                             cp_group=dist.group.WORLD, check_ranks=check)
        out.sum().backward()

    def timed(fn):
        dist.barrier()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    row = {"stage": 0, "check_ranks": 1}
    exchange = [timed(lambda: agreement.exchange(row, None, dist.group.WORLD, "cpu"))
                for _ in range(calls)]
    agreement.reset()
    with_check = [timed(lambda: step(True)) for _ in range(calls)]
    step(False)  # every rank passes False in an exchange: the group skips it from now on
    without = [timed(lambda: step(False)) for _ in range(calls)]
    with count_bytes() as counter:
        agreement.reset()
        step(True)
    big = torch.randn(weight_shape, generator=g).to(torch.bfloat16)
    checksum = [timed(lambda: agreement.weight_checksum(big)) for _ in range(calls)]
    same = [timed(lambda: agreement.check_same_weight(big, dist.group.WORLD)) for _ in range(calls)]
    return {"exchange": exchange, "with": with_check, "without": without,
            "bytes": counter.bytes("handshake", measure="wire"), "checksum": checksum,
            "same_weight": same}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--weight-rows", type=int, default=128 * (128 + 128))
    parser.add_argument("--kv-lora-rank", type=int, default=512)
    args = parser.parse_args()
    from mindspeed_laga.tools.spawn import run_on_ranks
    shape = (args.weight_rows, args.kv_lora_rank)
    per_rank = run_on_ranks(_worker, args.cp, args.seq_len, args.calls, shape, timeout_s=600)

    def ms(key):  # median per call of the slowest rank
        return 1e3 * max(statistics.median(r[key]) for r in per_rank)

    print(f"CP={args.cp} gloo, S={args.seq_len}, 16 heads, LAGA forward+backward, "
          f"median of {args.calls} calls, slowest rank")
    print(f"  handshake alone            {ms('exchange'):8.3f} ms  "
          f"({per_rank[0]['bytes']} bytes sent per rank)")
    print(f"  call, exchanging every call {ms('with'):8.3f} ms")
    print(f"  call, exchange skipped      {ms('without'):8.3f} ms")
    print(f"kv_up_weight {list(shape)} bfloat16, once per module (adapters' first call):")
    print(f"  checksum                    {ms('checksum'):8.3f} ms")
    print(f"  checksum + exchange         {ms('same_weight'):8.3f} ms")


if __name__ == "__main__":
    main()

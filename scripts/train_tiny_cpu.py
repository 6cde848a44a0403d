"""CPU demo: train a tiny megatron-core MLA GPT under context parallelism, with or without LAGA.

    torchrun --standalone --nproc-per-node 2 scripts/train_tiny_cpu.py --cp-algo allgather --laga
    torchrun --standalone --nproc-per-node 4 scripts/train_tiny_cpu.py --cp-algo ulysses --laga
    torchrun --standalone --nproc-per-node 4 scripts/train_tiny_cpu.py --cp-algo hybrid \
        --ulysses-degree 2 --laga                                              # hybrid CP
    torchrun --standalone --nproc-per-node 2 scripts/train_tiny_cpu.py          # megatron's own

Every rank runs gloo on CPU; CP size = world size / TP size. Without --laga,
megatron's unpatched MLA forward runs with a small CP-capable core attention
(tests/support/megatron_cpu.py). Rank 0 prints the global loss of each step and the
bytes the attention collectives moved. The model, shims and trainer are the
ones the end-to-end tests use (tests/support/megatron_cpu.py).
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

# The demo runs from a checkout: it shares the CPU harness of the end-to-end tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
# megatron's own notices on CPU (no Apex, cuda-graph scope, torch's renamed collectives).
warnings.filterwarnings("ignore", message=r".*(Apex|full scope is deprecated|is deprecated\. "
                                          r"Please use|CUDA_DEVICE_MAX_CONNECTIONS).*")

import functools  # noqa: E402

import torch.distributed as dist  # noqa: E402

import megatron_cpu as mc  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--laga", action="store_true", help="patch MLASelfAttention with LAGA")
    p.add_argument("--form", choices=("laga", "explicit"), default="laga",
                   help="core behind the patch (explicit: per-head K/V on the wire)")
    p.add_argument("--cp-algo", choices=("allgather", "ulysses", "hybrid"), default="allgather")
    p.add_argument("--ulysses-degree", type=int, default=None,
                   help="hybrid: CP ranks per Ulysses group (batches get the hybrid zigzag)")
    p.add_argument("--layout", choices=("zigzag", "contiguous"), default=None,
                   help="how batches are split over CP (default: zigzag for allgather and "
                        "hybrid, contiguous for ulysses); the demo shards accordingly and tells "
                        "the patch")
    p.add_argument("--kernel", choices=("auto", "eager", "sdpa"), default="auto")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--rope-type", choices=("rope", "yarn"), default="yarn")
    p.add_argument("--fresh-batches", action="store_true",
                   help="a new random batch each step (default: one batch, so the loss falls)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    layout = args.layout or ("contiguous" if args.cp_algo == "ulysses" else "zigzag")
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.tp:
        raise ValueError(f"--tp {args.tp} must divide the world size {world}")
    cp = world // args.tp
    if not args.laga and cp > 1 and layout != "zigzag":
        raise ValueError("without --laga megatron's forward needs zigzag batches: drop --layout "
                         "contiguous or add --laga")
    if not args.laga and args.cp_algo == "hybrid":
        raise ValueError("--cp-algo hybrid needs --laga: megatron's own MLA has no hybrid CP")
    import mindspeed_laga
    from mindspeed_laga import count_bytes

    mc.init_parallel(tp=args.tp, cp=cp)
    if args.laga:
        mindspeed_laga.patch_megatron_mla(cp_algo=args.cp_algo, layout=layout, form=args.form,
                                          kernel=args.kernel, ulysses_degree=args.ulysses_degree)
    tiny = mc.TinyMLA(seq_length=args.seq_length, rope_type=args.rope_type)
    model = mc.build_tiny_mla_gpt(tiny, tp=args.tp, cp=cp)
    if rank == 0:
        mode = f"LAGA patch (form={args.form}, cp_algo={args.cp_algo})" if args.laga \
            else "megatron's own MLA forward"
        print(f"world={world} TP={args.tp} CP={cp} layout={layout} S={tiny.seq_length}: {mode}",
              flush=True)

    def report(step, loss):
        if rank != 0:
            return
        line = f"step {step}: loss {loss:.6f}"
        if args.laga:  # the patch's core counts its collectives; megatron's own are not counted
            line += f"   bytes sent by rank 0's attention so far: {counter.bytes(measure='wire')}"
        print(line, flush=True)

    batches = mc.make_batches(tiny, args.steps)
    if not args.fresh_batches:
        batches = batches[:1] * args.steps
    with count_bytes() as counter:
        mc.train(model, batches, layout=_sharder(args, layout), tp=args.tp, lr=args.lr,
                 on_step=report)
    dist.destroy_process_group()


def _sharder(args, layout):
    """The batch split the patch is told: hybrid zigzag needs its own (not megatron's)."""
    if args.cp_algo == "hybrid" and layout == "zigzag":
        return functools.partial(mc.shard_hybrid, ulysses_degree=args.ulysses_degree)
    return layout


if __name__ == "__main__":
    main()

"""CPU demo: train a tiny megatron-core MLA GPT under context parallelism, with or without LAGA.

    torchrun --standalone --nproc-per-node 2 scripts/train_tiny_cpu.py --cp-algo allgather --laga
    torchrun --standalone --nproc-per-node 4 scripts/train_tiny_cpu.py --cp-algo ulysses --laga
    torchrun --standalone --nproc-per-node 4 scripts/train_tiny_cpu.py --cp-algo hybrid \
        --ulysses-degree 2 --laga                                              # hybrid CP
    torchrun --standalone --nproc-per-node 2 scripts/train_tiny_cpu.py          # megatron's own

Every rank runs gloo on CPU; CP size = world size / TP size. Without --laga,
megatron's unpatched MLA forward runs with a small CP-capable core attention
(mindspeed_laga/tools/megatron_cpu.py). Rank 0 prints the global loss of each step and the
bytes the attention collectives moved. The model, shims and trainer are the
ones the end-to-end tests use (mindspeed_laga/tools/megatron_cpu.py).

The configuration (world size, TP, CP algorithm, layout, sequence length) is
checked before anything is built: a combination the model cannot run fails
in one line naming the flag. ``--check-world N`` checks it for a world of N
ranks and exits (train_tiny_cpu.sh does so before torchrun starts).
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

# megatron's own notices on CPU (no Apex, cuda-graph scope, torch's renamed collectives).
warnings.filterwarnings("ignore", message=r".*(Apex|full scope is deprecated|is deprecated\. "
                                          r"Please use|CUDA_DEVICE_MAX_CONNECTIONS).*")

import functools  # noqa: E402

import torch.distributed as dist  # noqa: E402

from mindspeed_laga.tools import megatron_cpu as mc  # noqa: E402

from mindspeed_laga.cp_algos import algo  # noqa: E402
from mindspeed_laga.kernels.registry import CPU_KERNELS, canonical  # noqa: E402
from mindspeed_laga.vocab.names import ATTN_CP_ALGOS  # noqa: E402
from mindspeed_laga.vocab.segments import check_seq_len  # noqa: E402


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as the configuration checks print theirs
        print(f"train_tiny_cpu: error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv=None):
    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--laga", action="store_true", help="patch MLASelfAttention with LAGA")
    p.add_argument("--form", choices=("laga", "explicit"), default="laga",
                   help="core behind the patch (explicit: per-head K/V on the wire)")
    p.add_argument("--cp-algo", choices=ATTN_CP_ALGOS, default="allgather")
    p.add_argument("--ulysses-degree", type=int, default=None,
                   help="hybrid: CP ranks per Ulysses group (batches get the hybrid zigzag)")
    p.add_argument("--layout", choices=("zigzag", "contiguous"), default=None,
                   help="how batches are split over CP (default: zigzag for allgather and "
                        "hybrid, contiguous for ulysses); the demo shards accordingly and tells "
                        "the patch")
    p.add_argument("--kernel", type=canonical, choices=("auto",) + CPU_KERNELS, default="auto")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--rope-type", choices=("rope", "yarn"), default="yarn")
    p.add_argument("--fresh-batches", action="store_true",
                   help="a new random batch each step (default: one batch, so the loss falls)")
    p.add_argument("--check-world", type=int, default=None, metavar="N",
                   help="only check the configuration for a world of N ranks, then exit")
    return p.parse_args(argv)


def check_config(args, world: int):
    """(CP size, layout), or ValueError naming what the tiny model cannot run."""
    layout = args.layout or algo(args.cp_algo).default_layout
    for flag, value in (("--tp", args.tp), ("--steps", args.steps),
                        ("--seq-length", args.seq_length), ("world size (NPROC)", world)):
        if value < 1:
            raise ValueError(f"{flag} must be positive, got {value}")
    if world % args.tp:
        raise ValueError(f"--tp {args.tp} must divide the world size {world} (NPROC)")
    cp = world // args.tp
    heads = mc.TinyMLA().num_attention_heads
    if heads % args.tp:
        raise ValueError(f"--tp {args.tp} must divide the model's {heads} heads")
    if not args.laga and cp > 1 and layout != "zigzag":
        raise ValueError("without --laga megatron's forward needs zigzag batches: drop --layout "
                         "contiguous or add --laga")
    if not args.laga and algo(args.cp_algo).takes_ulysses_degree:
        raise ValueError("--cp-algo hybrid needs --laga: megatron's own MLA has no hybrid CP")
    degree = _check_heads_split(args, cp, heads // args.tp)
    try:
        check_seq_len(args.seq_length, layout, cp, ulysses_degree=degree)
    except ValueError as exc:
        raise ValueError(f"--seq-length {args.seq_length} with CP={cp} (world {world} / TP "
                         f"{args.tp}), layout={layout}: {exc}") from None
    return cp, layout


def _check_heads_split(args, cp: int, heads: int) -> int:
    """U of hybrid CP (1 otherwise); the heads per TP rank must split as the algorithm does."""
    degree = args.ulysses_degree
    split = algo(args.cp_algo)
    if not split.takes_ulysses_degree:
        if degree is not None:
            raise ValueError(f"--ulysses-degree goes with --cp-algo hybrid, not {args.cp_algo}")
        if args.laga and not split.heads_divide(heads, cp):
            raise ValueError(f"--cp-algo ulysses splits the model's {heads} heads (per TP rank) "
                             f"over CP={cp} ranks, and {cp} does not divide {heads}: use a world "
                             "size (NPROC) whose CP divides the heads (2 or 4), or --cp-algo "
                             "allgather")
        return 1
    if degree is None or not split.degree_divides(cp, degree) \
            or not split.heads_divide(heads, cp, degree):
        raise ValueError(f"--cp-algo hybrid needs --ulysses-degree U (ULYSSES_DEGREE) dividing "
                         f"both CP={cp} and the {heads} heads per TP rank, got {degree}")
    return degree


def main(argv=None):
    args = parse_args(argv)
    world = args.check_world or int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cp, layout = check_config(args, world)
    except ValueError as exc:  # one line (on rank 0 under torchrun), before anything is built
        if os.environ.get("RANK", "0") == "0":
            print(f"train_tiny_cpu: error: {exc}", file=sys.stderr)
        sys.exit(2)
    if args.check_world:
        return
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
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
    del model  # its modules hold process groups too
    _tear_down()


def _tear_down():
    """Free every group while the backend still runs, in order: megatron's (its module
    globals would otherwise keep them until the interpreter's own teardown, whose order
    is unspecified), then the world."""
    import gc

    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _sharder(args, layout):
    """The batch split the patch is told: hybrid zigzag needs its own (not megatron's)."""
    if algo(args.cp_algo).takes_ulysses_degree and layout == "zigzag":
        return functools.partial(mc.shard_hybrid, ulysses_degree=args.ulysses_degree)
    return layout


if __name__ == "__main__":
    main()

"""LAGA's host-side time per MLA layer call in steady state, against the host's own forward.

    python scripts/dev/host_time.py                  # 2 gloo ranks on CPU, about a minute
    python scripts/dev/host_time.py --repeats 200 --layers 4

At small dims on CPU the arithmetic costs next to nothing, so what a call takes is its
Python and dispatch overhead: the time the host spends launching a layer, which on an
accelerator is what must stay ahead of the device. On 2 gloo ranks (CP = 2) it builds
megatron-core's tiny MLA GPT (mindspeed_laga.tools.megatron_cpu, ``--layers`` layers), and
times, on the same modules and inputs, per layer call:

- LAGA: ``MLASelfAttention.forward`` patched by ``patch_megatron_mla`` (allgather);
- the host: megatron-core's own ``MLASelfAttention.forward`` (the flag off; its core
  attention is megatron_cpu's CP baseline, which all-gathers K and V: megatron-core's own
  CP attention has no CPU path).

The layers are called in a chain (forward, then backward of the chain), as in a model, so
every layer past the first runs in steady state (the first opens the micro-batch). The
two run interleaved, one repeat each in turn (their order alternating), after a barrier,
so drifts in the machine's load fall on both alike. Each call is timed on two clocks:

- CPU: the calling thread's CPU time (``time.thread_time``): the host's own work, Python
  and dispatch. It leaves out the time a rank sleeps in a collective waiting for its
  peer (gloo blocks there; on an accelerator the collective is queued and the host goes
  on) and the time the process is descheduled, so it holds still on a loaded machine;
- wall: ``time.perf_counter``, that wait included, as a rank lives it on this machine.

Printed for each clock: the median forward time of the steady-state layers, the median
backward time per layer, their sum, for each, and LAGA's ratio to the host (the slower
rank's medians); then the part of LAGA's forward spent in the cross-rank agreement
(``agree_on_call``: building and recording the call's row), median per later call. Last,
the launches: the aten ops one later layer call's forward dispatches on each rank
(counted with a ``TorchDispatchMode``, untimed).

``--without PART`` (repeatable, or ``all``) adds a LAGA run with those guarantees replaced
by no-ops, interleaved with the others, to show what each costs (measuring only: such a
run checks less): ``in_band``, a later call's code and verdict in its gather;
``weight_hash``, the device hash of its weight and FP8 scales; ``nonfinite_guard``, the
rows a non-finite key or value reaches.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def _now():
    return {name: clock() for name, clock in CLOCKS.items()}


def _since(start):
    return {name: clock() - start[name] for name, clock in CLOCKS.items()}


def _chain(attentions, forward, hidden):
    """Forward through every layer (timed per layer), then backward of the chain."""
    import torch.distributed as dist
    dist.barrier()
    times, h = [], hidden
    for attention in attentions:
        start = _now()
        h, _ = forward(attention, h, None)
        times.append(_since(start))
    start = _now()
    h.sum().backward()
    return times, _since(start)


def _launches(attentions, forward, hidden) -> int:
    """aten ops one later layer call's forward dispatches (a chain's second layer)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    h, _ = forward(attentions[0], hidden, None)
    with Count() as count:
        forward(attentions[1], h, None)
    return count.ops


def _timed_agreement(spent):
    """Wrap the dense forms' agreement call so its time lands in ``spent`` (a list)."""
    from mindspeed_laga import checks
    inner = checks.agree_on_call

    def agree_on_call(*args, **kwargs):
        start = _now()
        try:
            return inner(*args, **kwargs)
        finally:
            spent.append(_since(start))
    checks.agree_on_call = agree_on_call


WITHOUT = ("in_band", "weight_hash", "nonfinite_guard")


@contextlib.contextmanager
def _without(parts):
    """LAGA's guarantees named in ``parts`` (of WITHOUT) as no-ops, for the calls inside."""
    import torch
    from mindspeed_laga.agreement import inband, schedule
    from mindspeed_laga.kernels import nonfinite
    stubs = {"in_band": [(inband, "_band", lambda *a, **k: None)],
             "weight_hash": [(schedule, "device_code", lambda *a, **k: None)],
             "nonfinite_guard": [
                 (nonfinite, "nan_positions",
                  lambda *xs: torch.zeros(xs[0].shape[:-1], device=xs[0].device)),
                 (nonfinite, "zero_bad_positions", lambda x, bad, in_place: x),
                 (nonfinite, "row_poison", lambda *a, **k: 0)]}
    replaced = [(module, name, getattr(module, name), stub)
                for part in parts for module, name, stub in stubs[part]]
    for module, name, _, stub in replaced:
        setattr(module, name, stub)
    try:
        yield
    finally:
        for module, name, original, _ in replaced:
            setattr(module, name, original)


def _laga_without(forward, parts):
    def without(*args, **kwargs):
        with _without(parts):
            return forward(*args, **kwargs)
    return without


def worker(rank, world_size, layers, repeats, warmup, without=()):
    import warnings

    import torch
    warnings.simplefilter("ignore")  # megatron-core's CPU fallbacks warn on every call

    import mindspeed_laga
    spent = []
    _timed_agreement(spent)
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from mindspeed_laga.tools import megatron_cpu as mc

    tiny = mc.TinyMLA(num_layers=layers)
    mc.init_parallel(cp=world_size)
    model = mc.build_tiny_mla_gpt(tiny, cp=world_size)
    attentions = [layer.self_attention for layer in model.decoder.layers]
    mindspeed_laga.patch_megatron_mla(cp_algo="allgather")
    try:
        forwards = {"laga": MLASelfAttention.forward,
                    "host": MLASelfAttention.forward.__wrapped__}
        for parts in without:
            label = "all" if set(parts) == set(WITHOUT) else "+".join(parts)
            forwards["laga without " + label] = _laga_without(forwards["laga"], parts)
        generator = torch.Generator().manual_seed(rank)
        hidden = torch.randn(tiny.seq_length // world_size, tiny.micro_batch, tiny.hidden_size,
                             generator=generator).requires_grad_()
        samples = {(clock, name): {"forward": [], "backward": []}
                   for clock in CLOCKS for name in forwards}
        for repeat in range(warmup + repeats):
            order = list(forwards) if repeat % 2 == 0 else list(forwards)[::-1]
            for name in order:
                model.zero_grad(set_to_none=True)
                per_layer, backward = _chain(attentions, forwards[name], hidden)
                for clock in CLOCKS if repeat >= warmup else ():
                    sample = samples[clock, name]
                    # past the micro-batch's opening
                    sample["forward"].extend(t[clock] for t in per_layer[1:])
                    sample["backward"].append(backward[clock] / len(attentions))
                    if name.startswith("laga"):  # later calls' agreement (the first exchanges)
                        sample.setdefault("agreement", []).extend(
                            t[clock] for t in spent[-len(attentions) + 1:])
                spent.clear()
        medians = {key: {phase: statistics.median(values) for phase, values in phases.items()}
                   for key, phases in samples.items()}
        medians["launches"] = {name: _launches(attentions, forward, hidden)
                               for name, forward in forwards.items()}
        return medians
    finally:
        mindspeed_laga.unpatch_megatron_mla()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="MLA layers in the chain (>= 2)")
    parser.add_argument("--repeats", type=int, default=100, help="timed repeats of each")
    parser.add_argument("--warmup", type=int, default=10, help="untimed repeats first")
    parser.add_argument("--without", action="append", default=[], metavar="PART",
                        choices=WITHOUT + ("all",),
                        help="also time LAGA with this guarantee as a no-op (repeatable; all: "
                             "each alone, then all together)")
    args = parser.parse_args(argv)
    if args.layers < 2:
        parser.error("--layers must be >= 2: the first layer of a chain opens the micro-batch")
    parts = list(WITHOUT) if "all" in args.without else list(dict.fromkeys(args.without))
    without = [(part,) for part in parts] + ([tuple(parts)] if len(parts) > 1 else [])
    from mindspeed_laga.tools.spawn import run_on_ranks
    per_rank = run_on_ranks(worker, 2, args.layers, args.repeats, args.warmup, without,
                            timeout_s=1800)
    print(f"MLA layer call on CPU, CP = 2 (gloo), tiny dims, {args.layers} layers chained, "
          f"{args.repeats} interleaved repeats; median ms per layer call (the slower rank)")
    for clock, what in (("cpu", "the thread's CPU time: the host's own work"),
                        ("wall", "wall clock: waits for the peer rank included")):
        print(f"\n{clock}: {what}")
        _table(clock, per_rank)
    launches = {name: [r["launches"][name] for r in per_rank] for name in per_rank[0]["launches"]}
    print(f"\naten ops per later layer call's forward, per rank: {launches}")
    return 0


def _table(clock, per_rank):
    names = list(per_rank[0]["launches"])  # host, laga, then each run without a guarantee
    names.insert(0, names.pop(names.index("host")))
    width = max(6, *map(len, names))
    print(f"{'':>{width}} {'forward':>9} {'backward':>9} {'total':>9}")
    rows = {}
    for name in names:
        forward = max(r[clock, name]["forward"] for r in per_rank) * 1e3
        backward = max(r[clock, name]["backward"] for r in per_rank) * 1e3
        rows[name] = (forward, backward, forward + backward)
        ratio = "" if name == "host" else "   ratio " + " ".join(
            f"{v / h:.2f}" for v, h in zip(rows[name], rows["host"]))
        print(f"{name:>{width}} {forward:9.3f} {backward:9.3f} {forward + backward:9.3f}{ratio}")
    agreement = max(r[clock, "laga"]["agreement"] for r in per_rank) * 1e3
    print(f"ratio: LAGA / host (forward, backward, total); agreement per later call: "
          f"{agreement:.3f} ms ({agreement / rows['host'][0]:.1%} of the host's forward)")


if __name__ == "__main__":
    sys.exit(main())

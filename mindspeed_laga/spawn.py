"""Run a function on P gloo processes on this machine and collect what each returns.

Used by the CLI (``verify``, ``bench``) and the tests. Processes are *spawned*,
not forked: forking after torch has started its thread pools can deadlock.
Results travel back serialized with ``torch.save`` so tensors outlive the
worker that made them.
"""
from __future__ import annotations

import io
import os
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    """A spawned rank raised; the message carries its traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue, timeout_s: float):
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        queue.put((rank, True, _dumps(result)))
    except BaseException:  # report everything, including KeyboardInterrupt in a child
        queue.put((rank, False, traceback.format_exc()))


def run_on_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300.0) -> List[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; returns results by rank.

    ``fn`` must be importable by name (a module-level function). The default
    process group is the CP group the worker uses.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, timeout_s),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: List[Any] = [None] * world_size
    errors = []
    deadline = time.monotonic() + timeout_s + 60
    for _ in range(world_size):
        rank, ok, payload = _next_report(queue, procs, deadline)
        if ok:
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors.append(f"rank {rank}:\n{payload}")
    for p in procs:
        p.join(timeout=30)
    if errors:
        raise WorkerError("\n".join(errors))
    return results


def _next_report(queue, procs, deadline):
    """The next worker report; fail instead of waiting on ranks that died silently."""
    while True:
        try:
            return queue.get(timeout=1.0)
        except queue_mod.Empty:
            if time.monotonic() > deadline:
                raise WorkerError("timed out waiting for spawned ranks")
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                raise WorkerError(f"rank(s) {dead} died (exit codes "
                                  f"{[procs[i].exitcode for i in dead]}) without reporting")

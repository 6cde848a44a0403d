"""Run a function on P gloo processes on this machine and collect what each returns.

Used by the CLI (``verify``, ``bench``) and the tests.

- Processes come from a *fork server* that has already imported torch and this
  package: each call gets fresh processes (no state leaks from one call to the
  next) without paying torch's import in every rank. Plain ``fork`` of the
  caller is avoided: forking after torch has started its thread pools can
  deadlock; the fork server never computes, so it has no such pools.
- The ranks meet through a ``FileStore`` in a fresh temporary directory, not a
  TCP port: a port picked as "free" can be taken by another job before rank 0
  binds it, and then every rank waits out its timeout.
- ``timeout_s`` bounds the whole call: a rank that hangs is killed and
  :class:`WorkerError` raised. A rank that raises has its traceback in the
  error; the other ranks get a short grace to report, then are killed.
- Results travel back serialized with ``torch.save`` so tensors outlive the
  worker that made them.
"""
from __future__ import annotations

import faulthandler
import io
import os
import queue as queue_mod
import shutil
import signal
import site
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .die_with_parent import PARENT_ENV, die_with_parent
from .torchrun_env import under_torchrun  # noqa: F401  (callers import it from here too)

# Modules the fork server imports once so that ranks start warm; of WARM_IF_LOADED, those
# the caller has already imported when the server starts (a pytest run has, say,
# pytest and megatron.core, whose imports would otherwise cost every rank seconds).
PRELOAD = ["mindspeed_laga.tools.die_with_parent", "torch", "torch.distributed", "mindspeed_laga",
           "mindspeed_laga.tools.equivalence", "mindspeed_laga.tools.measure"]
WARM_IF_LOADED = ["pytest", "numpy", "megatron.core", "megatron.core.parallel_state",
                  "megatron.core.models.gpt"]
# After one rank failed, how long the others may still take to report (they are
# often blocked in a collective with the failed rank and will never return).
ERROR_GRACE_S = 5.0
# How long a rank that did not report gets to write its stacks when asked.
STACKS_WAIT_S = 0.5


class WorkerError(RuntimeError):
    """A spawned rank raised, died or hung; the message says which and carries tracebacks."""



def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _worker(rank: int, world_size: int, store_path: str, fn: Callable, args: tuple, queue,
            timeout_s: float, environ: dict):
    die_with_parent()  # the fork server's death (the caller's, SIGKILL included) ends this rank
    # The fork server holds the environment of its start; the ranks see the caller's now.
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    # Asked by the caller (SIGUSR1) when it gives up on this rank, it writes where each of
    # its threads waits; the caller's WorkerError quotes it.
    stacks = open(_stacks_path(store_path, rank), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    report = None
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        try:
            result = fn(rank, world_size, *args)
            # No rank leaves while another still needs the group (a rank that exits
            # during the others' connection setup makes them fail).
            dist.barrier()
            report = (rank, True, _dumps(result))
        except BaseException:  # everything, including KeyboardInterrupt in a child
            report = (rank, False, traceback.format_exc())
        # Report, its result or its error, before tearing the group down: gloo's teardown
        # can block once the other ranks have gone (seen with torch 2.7.1), and a rank
        # that has reported is one the caller may stop (``_stop``) instead of waiting for.
        _report(queue, report)
        dist.destroy_process_group()
    except BaseException:
        if report is None:  # the group never formed
            _report(queue, (rank, False, traceback.format_exc()))


def _report(queue, report) -> None:
    """Put ``report`` and wait until it is in the pipe. ``put`` only hands it to a feeder
    thread, which needs the GIL to write it; a teardown that blocks in native code holding
    the GIL would keep it from ever reaching the caller (seen under torch 2.7.1)."""
    queue.put(report)
    queue.close()
    queue.join_thread()


def _context():
    """The fork-server context, preloaded; ``spawn`` where there is no fork server."""
    try:
        ctx = mp.get_context("forkserver")
    except ValueError:
        return mp.get_context("spawn")
    # The fork server starts with this environment: it dies with this process (die_with_parent).
    os.environ[PARENT_ENV] = str(os.getpid())
    ctx.set_forkserver_preload(PRELOAD + _warm_modules())
    return ctx


def _warm_modules() -> List[str]:
    """WARM_IF_LOADED modules the caller has, when the fork server would load the same file.

    The fork server imports on the default ``sys.path``, not the caller's: a module the
    caller imported from a path it added at run time (a host source checkout put first
    on ``sys.path``) would be preloaded from site-packages instead, and its ranks would
    then run the wrong release."""
    roots = tuple(site.getsitepackages() + [site.getusersitepackages()])
    loaded = [name for name in WARM_IF_LOADED if name in sys.modules]
    megatron = [name for name in loaded if name.startswith("megatron")]
    installed = all((getattr(sys.modules[name], "__file__", None) or "").startswith(roots)
                    for name in megatron)
    return [name for name in loaded if installed or name not in megatron]


def run_on_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300.0) -> List[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; returns results by rank.

    ``fn`` must be importable by name (a module-level function). The default
    process group is the CP group the worker uses. Raises :class:`WorkerError`
    within about ``timeout_s`` seconds if a rank raises, dies or hangs.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = _context()
    queue = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="laga-rendezvous-")
    store_path = os.path.join(store_dir, "store")
    deadline = time.monotonic() + timeout_s
    procs = [ctx.Process(target=_worker, args=(r, world_size, store_path, fn, args, queue, timeout_s,
                                                    dict(os.environ)),
                         daemon=True) for r in range(world_size)]
    grace_s = 2.0
    try:
        for p in procs:
            p.start()
        results, errors = _collect(queue, procs, world_size, deadline, store_path)
    except BaseException:  # interrupted (Ctrl-C, SIGTERM): the ranks are not waited for
        grace_s = 0.0
        raise
    finally:
        _stop(procs, grace_s)
        queue.close()
        shutil.rmtree(store_dir, ignore_errors=True)
    if errors:
        raise WorkerError("\n".join(errors))
    return results


def _collect(queue, procs, world_size: int, deadline: float, store_path: str):
    """Every rank's report, or the errors so far once a rank failed, died or the time is up."""
    results: List[Any] = [None] * world_size
    errors: List[str] = []
    pending = set(range(world_size))
    dead_since = {}  # a report sent just before exit may still be in the pipe: wait a little
    while pending:
        try:
            rank, ok, payload = queue.get(timeout=0.2)
        except queue_mod.Empty:
            now = time.monotonic()
            for r in pending:
                if procs[r].exitcode is not None:
                    dead_since.setdefault(r, now)
            dead = sorted(r for r, t in dead_since.items() if r in pending and now - t > 1.0)
            if dead:
                errors.append(f"rank(s) {dead} died (exit codes "
                              f"{[procs[r].exitcode for r in dead]}) without reporting")
                break
            if now > deadline:
                errors.append(f"timed out waiting for spawned rank(s) {sorted(pending)}")
                break
            continue
        pending.discard(rank)
        if ok:
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors.append(f"rank {rank}:\n{payload}")
            deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
    if errors and pending:
        errors.append(f"rank(s) {sorted(pending)} did not report; killed")
        errors.extend(_where_they_wait(procs, sorted(pending), store_path))
    return results, errors


def _stacks_path(store_path: str, rank: int) -> str:
    return f"{store_path}.stacks-{rank}"


def _where_they_wait(procs, ranks: List[int], store_path: str) -> List[str]:
    """The stacks of ``ranks`` still running, each written by the rank when signalled."""
    asked = []
    for r in ranks:
        if procs[r].is_alive():
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
                asked.append(r)
            except ProcessLookupError:
                pass
    time.sleep(STACKS_WAIT_S if asked else 0)
    found = []
    for r in asked:
        try:
            with open(_stacks_path(store_path, r)) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            found.append(f"rank {r} was waiting in:\n{text}")
    return found


def _stop(procs, grace_s: float = 2.0) -> None:
    """Join ranks that finished (within ``grace_s`` each); kill the rest so no hung rank
    outlives the call."""
    for p in procs:
        if p.pid is not None:
            p.join(timeout=grace_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)

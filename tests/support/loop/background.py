"""Loop runs that a test can start in the background: a one-rank CP = 1 reference leaves
one of CI's two cores idle while it imports and trains, so a test starts its reference
beside the multi-rank run it is compared with and waits for it when it compares.

At most one background run at a time in the whole pytest process (one worker thread):
with the test's own run that is the machine's two cores. Each background run trains on its own
copy of the dataset (Megatron's rank 0 writes its sample-index cache next to the data,
not atomically, so two concurrent runs must not share a data folder), in its own output
folder, on its own rendezvous port (real_loop.run_loop asks the OS for a free one per
run). It is bounded by the same timeout as a foreground run; its failure (with its log
tail) is raised in the test that waits for it.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from pathlib import Path

from . import real_loop

_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loop-background")


class Runner:
    """``runner(name, *args, **kwargs)`` -> LoopRun, each name run once in ``workdir / name``;
    ``runner.start(name, *args, **kwargs)`` begins that run in the background and returns at
    once (a later call with that name waits for it). ``argv_for(ready, *args, **kwargs)`` ->
    (argv, processes) or (argv, processes, more keyword arguments of real_loop.run_loop),
    ``ready`` being what :func:`real_loop.prepare` returns: the writable sources and the
    data path, a separate copy of the dataset for background runs."""

    def __init__(self, sources: dict, workdir: Path, argv_for, timeout_s: float):
        documents = real_loop.default_documents()
        self._ready = {False: real_loop.prepare(sources, workdir, documents),
                       True: real_loop.prepare(sources, workdir / ".background", documents)}
        self._workdir, self._argv_for, self._timeout_s = workdir, argv_for, timeout_s
        self._runs = {}  # name -> LoopRun, or the Future of a background run

    def _call(self, background: bool, name: str, args, kwargs):
        ready = self._ready[background]
        argv, nproc, *options = self._argv_for(ready, *args, **kwargs)
        return lambda: real_loop.run_loop(ready["sources"], self._workdir / name, nproc, argv,
                                          timeout_s=self._timeout_s, **dict(*options))

    def start(self, name: str, *args, **kwargs) -> None:
        if name not in self._runs:
            self._runs[name] = _WORKER.submit(self._call(True, name, args, kwargs))

    def __call__(self, name: str, *args, **kwargs) -> real_loop.LoopRun:
        if name not in self._runs:
            self._runs[name] = self._call(False, name, args, kwargs)()
        elif isinstance(self._runs[name], Future):
            self._runs[name] = self._wait(name)
        return self._runs[name]

    def _wait(self, name: str) -> real_loop.LoopRun:
        """The background run's outcome; a failed one is forgotten (a later call runs it
        again in the foreground) and raised here, as a foreground failure would be."""
        future = self._runs[name]
        try:  # it may queue behind one other background run
            return future.result(timeout=2 * self._timeout_s + 60)
        except FutureTimeout:
            raise real_loop.LoopFailed(f"the background run {name} did not finish in "
                                       f"{2 * self._timeout_s + 60} s") from None
        except BaseException:
            del self._runs[name]
            raise

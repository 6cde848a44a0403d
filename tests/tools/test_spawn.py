"""The multi-rank runner: rendezvous that no other job can steal, and every failure
of a rank (hang, exception, death) turned into a bounded, explained error."""
import os
import re
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from mindspeed_laga.tools.spawn import WorkerError, run_on_ranks


def _sum_worker(rank, world, token):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return token, int(t.item()), os.getpid()


def _expected_sum(world):
    return world * (world + 1) // 2



def test_two_runs_at_once_keep_their_own_groups():
    """Concurrent calls rendezvous separately: each group sums only its own ranks."""
    got, failures = {}, []

    def call(token, world):
        try:
            got[token] = run_on_ranks(_sum_worker, world, token, timeout_s=120)
        except BaseException as exc:  # reported by the assertion below
            failures.append(exc)

    threads = [threading.Thread(target=call, args=(token, world)) for token, world in (("x", 2), ("y", 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not failures, failures
    assert [r[:2] for r in got["x"]] == [("x", _expected_sum(2))] * 2
    assert [r[:2] for r in got["y"]] == [("y", _expected_sum(3))] * 3


def _hang_worker(rank, world, pid_dir):
    # The default group times out with the call (timeout_s): rank 0 would then race the
    # caller's deadline and could be raising, not waiting, when asked where it waits.
    group = dist.new_group([0, 1], timeout=timedelta(hours=1))
    (pid_dir / f"{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        time.sleep(3600)  # never reaches the collective
    dist.barrier(group=group)
    return rank


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_hung_rank_raises_within_the_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(WorkerError, match="timed out|did not report") as raised:
        run_on_ranks(_hang_worker, 2, tmp_path, timeout_s=5)
    elapsed = time.monotonic() - start
    assert elapsed < 5 + 15, elapsed  # the timeout plus stopping the processes
    pids = [int((tmp_path / f"{r}.pid").read_text()) for r in range(2)]
    assert all(_gone(p) for p in pids), "hung ranks must not outlive the call"
    # the error quotes where each rank that did not report waits
    text = str(raised.value)
    assert "rank 1 was waiting in:" in text and "in _hang_worker" in text, text
    assert "rank 0 was waiting in:" in text and "in barrier" in text, text


def _raise_on_rank_one(rank):
    raise RuntimeError(f"boom on rank {rank}")


def _raise_worker(rank, world):
    if rank == 1:
        _raise_on_rank_one(rank)
    dist.barrier()  # rank 0 would wait here for the rank that failed
    return rank


def test_raising_rank_surfaces_its_traceback():
    start = time.monotonic()
    with pytest.raises(WorkerError) as err:
        run_on_ranks(_raise_worker, 2, timeout_s=120)
    text = str(err.value)
    assert "rank 1:" in text and "Traceback" in text and "_raise_on_rank_one" in text
    assert "RuntimeError: boom on rank 1" in text
    assert time.monotonic() - start < 60  # the rank left waiting is killed, not waited out



def _gil_held_forever():
    re.match(r"(a+)+$", "a" * 64 + "b")  # the regex engine never lets go of the GIL


def _teardown_hangs_worker(rank, world, fails):
    """This rank's gloo teardown blocks in native code holding the GIL, as torch 2.7.1's
    can: the report must be in the caller's pipe before it starts."""
    dist.destroy_process_group = _gil_held_forever
    if fails:
        raise RuntimeError(f"boom on rank {rank}")
    return rank


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fails", [False, True])
def test_a_report_reaches_the_caller_though_the_teardown_hangs(fails):
    start = time.monotonic()
    if fails:
        with pytest.raises(WorkerError, match="boom on rank 0") as err:
            run_on_ranks(_teardown_hangs_worker, 2, True, timeout_s=60)
        assert "boom on rank 1" in str(err.value) and "timed out" not in str(err.value)
    else:
        assert run_on_ranks(_teardown_hangs_worker, 2, False, timeout_s=60) == [0, 1]
    assert time.monotonic() - start < 30  # reported at once; the hung ranks are killed

def _exit_worker(rank, world):
    if rank == 1:
        os._exit(3)
    return rank


def test_rank_that_dies_is_named():
    with pytest.raises(WorkerError, match=r"rank\(s\) \[1\] died \(exit codes \[3\]\)"):
        run_on_ranks(_exit_worker, 2, timeout_s=60)


def _env_worker(rank, world):
    return os.environ.get("LAGA_SPAWN_TEST_VALUE"), torch.get_num_threads()


def test_ranks_see_the_callers_environment(monkeypatch):
    monkeypatch.setenv("LAGA_SPAWN_TEST_VALUE", "now")
    assert run_on_ranks(_env_worker, 2, timeout_s=60) == [("now", 1)] * 2

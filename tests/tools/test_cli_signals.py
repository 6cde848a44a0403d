"""SIGTERM (what ``timeout`` and batch schedulers send) ends ``bench``/``verify`` with
every process they started: the ranks, the fork server and the resource tracker."""
import os
import signal
import subprocess
import sys
import time

import pytest

TINY = ["--cp", "2", "--heads", "4", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
        "--v-head-dim", "8", "--kv-lora-rank", "16"]
# Enough timed runs that the command is still running when the signal comes.
COMMANDS = {
    "bench": ["bench", *TINY, "--seq-lens", "64", "--cp-algo", "allgather", "--forms-only",
              "--repeat", "100000", "--json", "", "--plot", ""],
    "verify": ["verify", *TINY, "--seq-len", "64", "--cp-algo", "allgather", "--repeat", "100000"],
}


def _descendants_of(leader: int):
    """Pids of the live (not zombie) processes whose setsid leader is ``leader`` (the command
    was started as one, so everything it starts shares that id unless it calls setsid)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == leader and fields[0] != "Z":  # fields[3]: the setsid leader's pid
            pids.append(int(name))
    return pids


def _kill_all(proc) -> None:
    """Kill what this test started (every process under the command's setsid leader), nothing else."""
    for pid in _descendants_of(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_sigterm_leaves_no_process_behind(command):
    proc = subprocess.Popen([sys.executable, "-m", "mindspeed_laga.tools.cli", *COMMANDS[command]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)  # a setsid leader: its pid tags everything it starts
    try:
        # the command, its fork server, its resource tracker and both ranks
        assert _wait(lambda: len(_descendants_of(proc.pid)) >= 5, 120), \
            f"ranks never started: {_descendants_of(proc.pid)}"
        time.sleep(1.0)  # the ranks are inside the timed loop
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        survivors = [] if _wait(lambda: not _descendants_of(proc.pid), 20) else _descendants_of(proc.pid)
        assert not survivors, f"still alive after SIGTERM: {survivors}"
        err = proc.stderr.read().decode()
        assert code == 128 + signal.SIGTERM, (code, err)
        assert "Traceback" not in err and f"mindspeed-laga {command}: terminated" in err, err
    finally:
        _kill_all(proc)


@pytest.mark.timeout(240)
def test_sigkill_of_the_cli_ends_its_fork_server_and_ranks():
    """SIGKILL runs no ``finally``: the fork server and the ranks end by themselves, tied to
    their parent (PR_SET_PDEATHSIG), and the resource tracker once their pipes close."""
    proc = subprocess.Popen([sys.executable, "-m", "mindspeed_laga.tools.cli", *COMMANDS["verify"]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        assert _wait(lambda: len(_descendants_of(proc.pid)) >= 5, 120), \
            f"ranks never started: {_descendants_of(proc.pid)}"
        time.sleep(1.0)
        proc.kill()
        proc.wait(timeout=30)
        survivors = [] if _wait(lambda: not _descendants_of(proc.pid), 20) else _descendants_of(proc.pid)
        assert not survivors, f"still alive 20 s after SIGKILL of the CLI: {survivors}"
    finally:
        _kill_all(proc)

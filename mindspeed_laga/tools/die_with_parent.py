"""Spawned processes die with the process that started them, even when it is SIGKILLed
(no ``finally`` runs then): Linux's PR_SET_PDEATHSIG, set through ctypes.

Imported by the fork server as one of its preloaded modules: there, at import, it ties the
fork server to the CLI that started it (the CLI names itself in ``PARENT_ENV`` first); each
rank calls :func:`die_with_parent` as it starts, tying it to the fork server. Killing the
CLI thus ends the fork server, which ends the ranks; the resource tracker exits once the
last of them has closed its pipe. A no-op where prctl is unavailable.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PARENT_ENV = "MINDSPEED_LAGA_FORK_SERVER_PARENT"


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (exits at once if it already has)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # orphaned before the call: the signal will never come
        os._exit(1)


if os.environ.get(PARENT_ENV) == str(os.getppid()):  # this is the fork server of that parent
    die_with_parent()

"""How many CPU ranks this machine can spawn: each is a process holding torch (about 300 MiB)
and wants a share of a core. Checked before anything starts, so a CP size the machine
cannot hold is refused at once, naming the limit, instead of swapping or taking minutes
to fail. Torch-free."""
from __future__ import annotations

import os
from typing import Optional

RANK_MIB = 300        # one spawned rank: torch, the package, its tensors at CLI sizes
RANKS_PER_CORE = 8    # gloo ranks mostly wait on each other; more than this only queues


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_mib() -> Optional[int]:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def max_spawned_ranks() -> int:
    by_cores = RANKS_PER_CORE * cores()
    mem = available_mib()
    return by_cores if mem is None else max(1, min(by_cores, mem // RANK_MIB))


def check_spawnable(ranks: int, flag: str = "--cp") -> None:
    """ValueError naming ``flag`` when this machine cannot hold ``ranks`` spawned ranks."""
    cap = max_spawned_ranks()
    if ranks > cap:
        mem = available_mib()
        memory = f", {mem / 1024:.1f} GiB available" if mem is not None else ""
        raise ValueError(
            f"{flag} {ranks} spawns {ranks} CPU processes, but this machine holds at most {cap} "
            f"({cores()} cores x {RANKS_PER_CORE}{memory}, ~{RANK_MIB} MiB a rank); use "
            f"{flag} {cap} or less, or launch the ranks with torchrun")

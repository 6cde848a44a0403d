"""What torchrun's environment says about this process, read without importing torch (the
CLI checks its flags against it before the ranks, or torch, start)."""
from __future__ import annotations

import os
from typing import Optional

from .rank_cap import check_spawnable


def under_torchrun() -> bool:
    """Whether this process is one rank of a torchrun job (its environment says so)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_rank() -> int:
    """This rank under torchrun (0 outside it): the one that prints what every rank would."""
    return int(os.environ.get("RANK", "0")) if under_torchrun() else 0


def world_size(cp: Optional[int], backend: Optional[str], default_cp: int) -> int:
    """The CP size a command runs at: torchrun's world size (a different --cp is refused), or
    --cp spawned gloo CPU ranks (--backend, which only torchrun's ranks use, is refused, and
    a --cp this machine cannot hold)."""
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if cp is not None and cp != world:
            raise ValueError(f"--cp {cp} differs from torchrun's world size {world}: under "
                             f"torchrun the world size is the CP size; drop --cp or launch {cp} ranks")
        return world
    if backend is not None:
        raise ValueError(f"--backend {backend} applies under torchrun only; without it the ranks "
                         "are spawned gloo CPU processes: drop --backend or launch with torchrun")
    cp = default_cp if cp is None else cp
    check_spawnable(cp)
    return cp

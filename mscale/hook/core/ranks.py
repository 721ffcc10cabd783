"""Which rank this process is: what the guard registers with the agent.

From torch.distributed when its process group is initialised (rank and world size), else the
launcher's environment (torchrun, Slurm through it, and most launchers set RANK, LOCAL_RANK,
WORLD_SIZE), else a single process: rank 0 of 1. LOCAL_RANK (the rank's index on its node,
usually its GPU) comes from the environment, as torch.distributed does not know it; unset,
the rank itself (one node).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch.distributed as dist


class RankIdentity(NamedTuple):
    rank: int
    local_rank: int
    world_size: int


def _env_int(name: str, default: int, lo: int) -> int:
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        v = int(raw)
    except ValueError:
        raise ValueError(f"environment {name}={raw!r}: expected an integer") from None
    if v < lo:
        raise ValueError(f"environment {name}={v}: expected at least {lo}")
    return v


def identify(rank: int | None = None) -> RankIdentity:
    """This process's rank, local rank and world size; `rank` given: that rank, the rest as found."""
    if dist.is_available() and dist.is_initialized():
        found, world = dist.get_rank(), dist.get_world_size()
    else:
        found, world = _env_int("RANK", 0, 0), _env_int("WORLD_SIZE", 1, 1)
    rank = found if rank is None else int(rank)
    local = _env_int("LOCAL_RANK", rank if world > 1 else 0, 0)  # unset: one node, rank i on GPU i
    if rank < 0:
        raise ValueError(f"rank {rank}: expected 0 or more")
    world = max(world, rank + 1)
    return RankIdentity(rank, local, world)

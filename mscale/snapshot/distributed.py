"""The collectives that make snapshot decisions agreed by every rank.

A rollback or a resume must land on the same step on all ranks or on none: ranks exchange a
fault flag (MAX) and the steps they hold, and each computes the same answer from the same
gathered data. Works with gloo (CPU tensors) and NCCL (tensors on the current CUDA device).
Without an initialised process group everything is local (rank 0 of 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def rank_and_size(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_flag(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank when any rank passes True (all_reduce MAX)."""
    if rank_and_size(group)[1] == 1:
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def gather_steps(steps: Sequence[int], group: dist.ProcessGroup | None = None) -> list[list[int]]:
    """Every rank's list of steps, on every rank."""
    world = rank_and_size(group)[1]
    if world == 1:
        return [list(steps)]
    dev = _device(group)
    n = torch.tensor([len(steps)], dtype=torch.int64, device=dev)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    width = max(int(n.item()), 1)
    mine = torch.full((width,), -1, dtype=torch.int64, device=dev)
    if steps:
        mine[: len(steps)] = torch.tensor(list(steps), dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [[int(s) for s in t.tolist() if s >= 0] for t in out]


def common_steps(steps: Sequence[int], group: dist.ProcessGroup | None = None) -> list[int]:
    """Steps every rank holds, newest first (identical on every rank)."""
    lists = gather_steps(steps, group)
    common = set(lists[0]).intersection(*map(set, lists[1:]))
    return sorted(common, reverse=True)


def newest_common(steps: Sequence[int], group: dist.ProcessGroup | None = None) -> int | None:
    """The newest step every rank holds: the MIN over ranks when all snapshot at the same
    steps, the newest of the intersection in general. None when there is none."""
    common = common_steps(steps, group)
    return common[0] if common else None

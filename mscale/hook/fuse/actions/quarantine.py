"""A fatal GPU fault: mark the GPU unusable for this job (no MPU is moved onto it again)."""

from __future__ import annotations

from mscale.healing import actions
from mscale.healing.engine import Decision
from mscale.healing.words import Result
from mscale.hook.fuse.actions.base import ActionFailed, Executor, FuseContext


class Quarantine:
    """The GPUs this job no longer uses."""

    def __init__(self, fuse: FuseContext) -> None:
        self.gpus: set[int] = set()

    def avoid_gpus(self, fuse: FuseContext) -> set[int]:
        return self.gpus


def apply(fuse: FuseContext, state: Quarantine, d: Decision) -> str:
    gpu = d.target.gpu
    if gpu is None:
        raise ActionFailed("no GPU index in the command")
    if gpu in state.gpus:
        return Result.NOOP
    state.gpus.add(gpu)
    return Result.APPLIED


EXECUTOR = Executor(actions.get("quarantine_gpu"), apply, state=Quarantine)

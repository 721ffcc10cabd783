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
    if not d.target.gpu.isdigit():
        raise ActionFailed(f"no GPU index in the command (gpu={d.target.gpu!r})")
    gpu = int(d.target.gpu)
    if gpu in state.gpus:
        return Result.NOOP
    state.gpus.add(gpu)
    return Result.APPLIED


EXECUTOR = Executor(actions.get("quarantine_gpu"), apply, state=Quarantine)

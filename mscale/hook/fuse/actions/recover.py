"""RECOVERED: a clean stretch after L1/L2/L3. The measures still in force are undone by their
own actions (`undo` of the L2 and L3 states: fallback, resolution, clip threshold,
distillation term); an L1 swap stays (the old GPU stays avoided)."""

from __future__ import annotations

from mscale.healing import actions
from mscale.healing.engine import Decision
from mscale.healing.words import Result
from mscale.hook.fuse.actions.base import Executor, FuseContext


def apply(fuse: FuseContext, state: None, d: Decision) -> str:
    fuse.dispatch("undo", fuse.guard.mpu(d.target.mpu_id))
    return Result.APPLIED


EXECUTOR = Executor(actions.get("recover"), apply)

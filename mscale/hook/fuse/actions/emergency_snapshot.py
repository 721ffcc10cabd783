"""A GPU fault or a hang: write the latest in-memory snapshot to disk now, before anything
else can go wrong."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

from mscale.healing import actions
from mscale.healing.engine import Decision
from mscale.healing.words import Result
from mscale.hook.fuse.actions.base import ActionFailed, Executor, FuseContext


class Emergencies:
    """The faults already written for (one write per fault, whichever path reports it) and
    the futures of the writes (each resolves to the snapshot's directory)."""

    def __init__(self, fuse: FuseContext) -> None:
        self.done: set[str] = set()
        self.writes: list[Future[Path]] = []


def apply(fuse: FuseContext, state: Emergencies, d: Decision) -> str:
    engine = fuse.snapshot_engine
    if engine is None:
        raise ActionFailed("no snapshot engine attached")
    if d.fault_key in state.done:
        return Result.NOOP  # the same fault from another path: written once
    if engine.latest() is None:
        raise ActionFailed("no in-memory snapshot yet")
    state.writes.append(engine.emergency(why=f"{d.reason} ({d.fault_key})"))
    state.done.add(d.fault_key)
    return Result.APPLIED


EXECUTOR = Executor(actions.get("emergency_snapshot"), apply, state=Emergencies)

"""SUSPECT: a checksum failure below the L1 threshold. Nothing moves; the state machine
remembers, and a clean stretch clears it."""

from __future__ import annotations

from mscale.healing import actions
from mscale.healing.engine import Decision
from mscale.healing.words import Result
from mscale.hook.fuse.actions.base import Executor, FuseContext


def apply(fuse: FuseContext, state: None, d: Decision) -> str:
    return Result.APPLIED


EXECUTOR = Executor(actions.get("mark_suspect"), apply)

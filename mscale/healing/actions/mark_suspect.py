"""SUSPECT: a checksum failure below the L1 threshold. Nothing moves; the state machine
remembers, and a clean stretch clears it."""

from __future__ import annotations

from mscale.healing.actions.base import ActionSpec
from mscale.healing.fsm import Level


def apply(fuse, state, d) -> str:
    return "applied"


ACTION = ActionSpec("mark_suspect", "none", Level.SUSPECT, apply, "mark the MPU suspect", scope="mpu")

"""RECOVERED: a clean stretch after L1/L2/L3. The L2 and L3 measures are undone (fallback, resolution,
clip threshold, distillation term); an L1 swap stays (the old GPU stays avoided)."""
from __future__ import annotations

from mscale.healing.actions.base import ActionSpec
from mscale.healing.fsm import Level


def apply(fuse, d) -> str:
    m = fuse.guard.mpu(d.target.mpu_id)
    fuse.stop_distill(m)
    fuse.undegrade(m)
    return "applied"


ACTION = ActionSpec("recover", "none", Level.RECOVERED, apply, "undo the L2/L3 measures after a clean stretch")

"""RECOVERED: a clean stretch after L1/L2/L3. The measures still in force are undone by their
own actions (`undo` of the L2 and L3 states: fallback, resolution, clip threshold,
distillation term); an L1 swap stays (the old GPU stays avoided)."""

from __future__ import annotations

from mscale.healing.actions.base import ActionSpec
from mscale.healing.fsm import Level


def apply(fuse, state, d) -> str:
    fuse.dispatch("undo", fuse.guard.mpu(d.target.mpu_id))
    return "applied"


ACTION = ActionSpec(
    "recover",
    "none",
    Level.RECOVERED,
    apply,
    "undo the L2/L3 measures after a clean stretch",
    scope="mpu",
    on_recovery=True,
)

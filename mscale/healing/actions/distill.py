"""L3 cross-modal distillation: the MPU keeps failing even degraded.

A KL term between the detached text-MPU hidden state and the projected output of the failing
MPU is added to the loss, weighted so that it is `healing.distill_weight_min`..`max` of the
total (adapted every step), until the MPU recovers; then it is removed. The text MPU itself
cannot be distilled from itself: for it the action is a no-op.
"""
from __future__ import annotations

from mscale.healing.actions.base import ActionFailed, ActionSpec
from mscale.healing.fsm import Level


def apply(fuse, d) -> str:
    m = fuse.guard.mpu(d.target.mpu_id)
    if m.name == "text":
        raise ActionFailed("the text MPU is the teacher; nothing to distill from")
    fuse.start_distill(m)
    return "applied"


ACTION = ActionSpec("l3_distill", "L3", Level.L3_DISTILLING, apply, "distill the failing MPU from the text MPU")

"""L2 modality degradation: the standby fails too, or none is healthy.

The MPU keeps training degraded: image inputs of a vision MPU at half resolution (a forward
pre-hook pools them, so the tower sees a quarter of the patches), and its CMSA clip
threshold raised by `healing.l2_clip_factor` to absorb the noisier gradients. On a GPU node
with `healing.l2_cpu_fallback` the MPU also moves to the CPU. Undone on recovery.
"""
from __future__ import annotations

from mscale.healing.actions.base import ActionSpec
from mscale.healing.fsm import Level


def apply(fuse, d) -> str:
    m = fuse.guard.mpu(d.target.mpu_id)
    fuse.degrade(m)
    return "applied"


ACTION = ActionSpec("l2_degrade", "L2", Level.L2_DEGRADED, apply, "run the MPU degraded (reduced resolution, raised clip)")

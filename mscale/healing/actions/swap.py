"""L1 MPU swap: move the MPU (parameters, gradients, optimizer state) to a standby GPU.

The standby is a GPU of the node that no MPU of this job uses, that is not quarantined and
that this MPU has not failed on. If the weights themselves fail their checksum they are
restored from the last verified in-memory snapshot first. Inside a forward the fuse then
re-runs the MPU's forward for the current batch on the standby, so the step completes with
a correct output. No standby: ActionFailed("no healthy standby"), and the fuse escalates.
"""
from __future__ import annotations

from mscale.healing.actions.base import ActionFailed, ActionSpec
from mscale.healing.fsm import Level


def apply(fuse, d) -> str:
    m = fuse.guard.mpu(d.target.mpu_id)
    if d.target.gpu and d.target.gpu.isdigit() and int(d.target.gpu) != m.gpu:
        return "noop"  # a command about a GPU this MPU has already left (another path moved it)
    old = m.gpu
    standby = fuse.standby_for(m)
    if standby is None:
        raise ActionFailed("no healthy standby GPU")
    restored = fuse.verify_weights(m)  # restores from the in-memory snapshot on a mismatch
    fuse.failed_on.setdefault(m.mpu_id, set()).add(old)
    fuse.move_mpu(m, standby)
    fuse.last_swap[m.mpu_id] = (old, standby, restored)
    return "applied"


ACTION = ActionSpec("l1_swap", "L1", Level.L1_SWAPPED, apply, "move the MPU to a standby GPU and re-run its forward")

"""NaN/Inf loss or a persisting spike: drop this step's update (its gradients never reach the
weights), then roll back to the last good in-memory snapshot and skip the offending batch.
Without a snapshot engine the step is still dropped, and the event says so."""
from __future__ import annotations

from mscale.healing.actions.base import ActionSpec


def apply(fuse, d) -> str:
    fuse.guard.request_skip(f"{d.reason}: rollback")
    fuse.schedule_rollback(d)
    return "step_dropped"  # the restore after the step books "applied" (or why not)


ACTION = ActionSpec("rollback", "none", None, apply, "drop the step, restore the last good snapshot, skip the batch")

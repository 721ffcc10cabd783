"""A GPU fault or a hang: write the latest in-memory snapshot to disk now, before anything
else can go wrong."""
from __future__ import annotations

from mscale.healing.actions.base import ActionFailed, ActionSpec


def apply(fuse, d) -> str:
    if fuse.snapshots is None:
        raise ActionFailed("no snapshot engine attached")
    if d.fault_key in fuse.emergency_done:
        return "noop"  # the same fault from another path: written once
    fuse.emergency_snapshot(d)
    fuse.emergency_done.add(d.fault_key)
    return "applied"


ACTION = ActionSpec("emergency_snapshot", "none", None, apply, "write the in-memory snapshot to disk now")

"""A fatal GPU fault: mark the GPU unusable for this job (no MPU is moved onto it again)."""
from __future__ import annotations

from mscale.healing.actions.base import ActionFailed, ActionSpec


def apply(fuse, d) -> str:
    if not d.target.gpu.isdigit():
        raise ActionFailed(f"no GPU index in the command (gpu={d.target.gpu!r})")
    gpu = int(d.target.gpu)
    if gpu in fuse.quarantined:
        return "noop"
    fuse.quarantined.add(gpu)
    return "applied"


ACTION = ActionSpec("quarantine_gpu", "none", None, apply, "mark the GPU unusable for the job")

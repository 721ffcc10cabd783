"""A fatal GPU fault: mark the GPU unusable for this job (no MPU is moved onto it again)."""

from __future__ import annotations

from mscale.healing.actions.base import ActionFailed, ActionSpec


class Quarantine:
    """The GPUs this job no longer uses."""

    def __init__(self, fuse) -> None:
        self.gpus: set[int] = set()

    def avoid_gpus(self, fuse) -> set[int]:
        return self.gpus


def apply(fuse, state: Quarantine, d) -> str:
    if not d.target.gpu.isdigit():
        raise ActionFailed(f"no GPU index in the command (gpu={d.target.gpu!r})")
    gpu = int(d.target.gpu)
    if gpu in state.gpus:
        return "noop"
    state.gpus.add(gpu)
    return "applied"


ACTION = ActionSpec(
    "quarantine_gpu", "none", None, apply, "mark the GPU unusable for the job", scope="gpu", state=Quarantine
)

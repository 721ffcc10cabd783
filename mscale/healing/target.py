"""What a healing decision acts on: a job, an MPU of a job, or a GPU (every MPU bound to it)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from mscale.healing.words import TargetKind
from mscale.link.wire import MAX_GPU_INDEX

_INDEX = re.compile(r"0|[1-9][0-9]{0,3}")


def gpu_of(v: object) -> int | None:
    """A GPU index label (text: "0".."4095", no sign, no leading zero, ASCII digits only) as
    the index, None when `v` is not one. The one place a label or a command field becomes a
    GPU index: everything past it carries the int."""
    if not isinstance(v, str) or not _INDEX.fullmatch(v):
        return None
    i = int(v)
    return i if i < MAX_GPU_INDEX else None


def gpu_label(index: int | None) -> str:
    """A GPU index as a label's or a command's text ("" when unknown)."""
    return "" if index is None else str(index)


@dataclass(frozen=True)
class Target:
    job_id: str = ""
    mpu_id: str = ""
    gpu: int | None = None  # GPU index (None when unknown)
    gpu_uuid: str = ""

    @property
    def gpu_key(self) -> str:
        """The GPU's identity: its UUID, else its index as text ("" when neither is known)."""
        return self.gpu_uuid or gpu_label(self.gpu)

    def key(self, kind: str) -> tuple[str, ...]:
        """The fault's identity under a rule's target kind (the dedup ledger's key): a GPU fault
        is one fault for every MPU bound to the GPU, and stays one after they moved off it."""
        if kind == TargetKind.GPU:
            return (TargetKind.GPU, self.gpu_key)
        if kind == TargetKind.JOB:
            return (TargetKind.JOB, self.job_id)
        return (TargetKind.MPU, self.job_id, self.mpu_id)

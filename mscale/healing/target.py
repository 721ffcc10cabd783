"""What a healing decision acts on: a job, an MPU of a job, or a GPU (every MPU bound to it)."""

from __future__ import annotations

from dataclasses import dataclass

from mscale.healing.words import TargetKind


@dataclass(frozen=True)
class Target:
    job_id: str = ""
    mpu_id: str = ""
    gpu: str = ""  # GPU index as text ("" when unknown)
    gpu_uuid: str = ""

    def key(self, kind: str) -> tuple[str, ...]:
        """The fault's identity under a rule's target kind (the dedup ledger's key): a GPU fault
        is one fault for every MPU bound to the GPU, and stays one after they moved off it."""
        if kind == TargetKind.GPU:
            return (TargetKind.GPU, self.gpu_uuid or self.gpu)
        if kind == TargetKind.JOB:
            return (TargetKind.JOB, self.job_id)
        return (TargetKind.MPU, self.job_id, self.mpu_id)

"""The node as the engine sees it in the agent: one row per (job, rank, MPU) with the GPU the
MPU is bound to, and the GPU probe's index <-> UUID map. The agent builds it from its state
(mscale.daemon.healing.node_view) and hands it to `HealingEngine.plan` with the condition, so
the engine resolves a rule's targets, and the ranks a decision goes to, without calling the
agent back. Torch-free and agent-free: plain data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from mscale.healing.target import Target, gpu_of
from mscale.healing.words import TargetKind


@dataclass(frozen=True, slots=True)
class NodeRow:
    """One MPU of one rank of a job, and the GPU it is bound to."""

    job_id: str
    rank: int
    mpu_id: str
    mpu_name: str = ""
    gpu: int | None = None  # index (None when unknown)
    gpu_uuid: str = ""


@dataclass(frozen=True)
class NodeView:
    """The rows in the agent's order (jobs as registered, ranks and MPUs sorted), every job id
    the agent holds, and GPU index -> UUID."""

    rows: tuple[NodeRow, ...] = ()
    jobs: tuple[str, ...] = ()
    gpus: Mapping[int, str] = field(default_factory=dict)

    def targets(self, kind: str, labels: Mapping[str, str]) -> list[Target]:
        """What a rule of target `kind` acts on, from a condition's labels."""
        job_id = labels.get("job_id", "")
        if kind == TargetKind.GPU:
            index = gpu_of(labels.get("gpu"))
            uuid = labels.get("gpu_uuid", "") or ("" if index is None else self.gpus.get(index, ""))
            if index is None:
                index = next((i for i, u in self.gpus.items() if uuid and u == uuid), None)
            hits = [
                Target(r.job_id, r.mpu_id, r.gpu, r.gpu_uuid or uuid)
                for r in self.rows
                if (index is not None and r.gpu == index) or (uuid and r.gpu_uuid == uuid)
            ]
            if job_id:
                hits = [t for t in hits if t.job_id == job_id]
            return hits or [Target("", "", index, uuid)]
        if kind == TargetKind.JOB:
            return [Target(j) for j in ([job_id] if job_id else sorted(self.jobs))]
        mpu_key = labels.get("mpu_id", "") or labels.get("mpu", "")
        out = [
            Target(r.job_id, r.mpu_id, r.gpu, r.gpu_uuid)
            for r in self.rows
            if (not job_id or r.job_id == job_id) and mpu_key in (r.mpu_id, r.mpu_name)
        ]
        if not out and job_id and mpu_key:
            out.append(Target(job_id, mpu_key))  # not connected: the send fails and says so
        return out

    def ranks(self, t: Target) -> tuple[int, ...] | None:
        """The ranks a decision on a GPU goes to: those whose MPU is bound to it (None: every
        rank of the job, for job and MPU targets, or when no rank is known to be there)."""
        if t.gpu is None or t.job_id not in self.jobs:
            return None
        ranks = sorted(
            {
                r.rank
                for r in self.rows
                if r.job_id == t.job_id and r.gpu == t.gpu and (not t.mpu_id or r.mpu_id == t.mpu_id)
            }
        )
        return tuple(ranks) or None

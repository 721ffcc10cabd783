"""The labels the agent puts on a job's finding before anyone reads it (mscale.daemon.link).

A job's finding names its job, its rank and, for most, an MPU and a GPU. Only the first and the
MPU are the job's to say: the job id and rank are its connection's, and the GPU is the agent's
own view of where that MPU ran, whatever the finding's labels say:

- `job_id`, `rank`, `local_rank`: the connection's registration;
- `gpu`: the GPU the finding names when it is one of the MPU's placements (the GPUs the MPU was
  registered, rebound or swapped to here: `MpuState.placements`), else the MPU's GPU now; for a
  finding that names no MPU, one of the rank's MPUs' placements, else none;
- `gpu_uuid`: the GPU probe's UUID of that GPU (the MPU's registered one only while the agent
  has no GPU data), else none: a job's text is never a finding's GPU;
- `to_gpu` (where an action moved the MPU): kept only as a GPU index (ASCII digits, below
  mscale.link's MAX_GPU_INDEX).

A proof (heal_action, fuse_state: what the remediation hand-off and the standby book read) about
an MPU the rank never registered is refused, and so is every proof of a message past
MAX_PROOFS_PER_MESSAGE: so a job can have at most the GPUs its own MPUs ran on filed for
remediation, and one message cannot flood the verdict book.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from mscale.daemon.gpus import GpuSample, gpu_index
from mscale.daemon.jobs import JobState
from mscale.findings import Finding, Reason

PROOFS = frozenset({Reason.HEAL_ACTION, Reason.FUSE_STATE})
# heal_action and fuse_state findings taken from one report message: a rank's fuse makes a few
# per MPU and step at most (MAX_MPUS MPUs), a flood is refused past it (proof_limit)
MAX_PROOFS_PER_MESSAGE = 64
_GPU_LABELS = ("gpu", "gpu_uuid", "to_gpu")


def labelled(job: JobState, rank: int, finding: Finding, gpus: Mapping[int, GpuSample]) -> Finding | None:
    """The finding with the agent's labels (above); None: a proof about an MPU this rank
    never registered."""
    labels = dict(finding.labels)
    rs = job.rank_state(rank)
    labels["job_id"], labels["rank"], labels["local_rank"] = job.job_id, str(rank), str(rs.local_rank)
    mpu_id = labels.get("mpu_id", "")
    m = rs.mpus.get(mpu_id) if mpu_id else None
    if m is None and mpu_id and finding.reason in PROOFS:
        return None
    claimed, to_gpu = gpu_index(labels.get("gpu", "")), gpu_index(labels.get("to_gpu", ""))
    for k in _GPU_LABELS:
        labels.pop(k, None)
    placements = m.placements if m is not None else [g for mm in rs.mpus.values() for g in mm.placements]
    gpu: int | None = None
    if claimed and int(claimed) in placements:
        gpu = int(claimed)
    elif m is not None and m.gpu >= 0:
        gpu = m.gpu
    if gpu is not None:
        labels["gpu"] = str(gpu)
        sample = gpus.get(gpu)
        uuid = str(getattr(sample, "uuid", "") or "") if sample is not None else ""
        if not uuid and not gpus and m is not None and gpu == m.gpu:
            uuid = m.gpu_uuid  # no GPU data at all: the MPU's own registration is all there is
        if uuid:
            labels["gpu_uuid"] = uuid
    if to_gpu:
        labels["to_gpu"] = to_gpu
    return dataclasses.replace(finding, labels=labels)

"""The agent's MPU health score (mscale.daemon.jobs): each term of the documented formula."""

from __future__ import annotations

import pytest

from mscale.daemon.jobs import JobState, gpus_by_index
from mscale.daemon.mpu_state import BASELINE_SKIP, BASELINE_STEPS
from mscale.daemon.state import AgentState
from mscale.link import MpuInfo, Register, StepReport
from mscale.probes.gpu import GpuSample, GpuSnapshot


def job() -> JobState:
    j = JobState(job_id="j", rank=0, pid=1)
    j.register(Register(job_id="j", rank=0, pid=1, mpus=(MpuInfo("001", "vision", 3), MpuInfo("002", "text", 4))))
    return j


def report(step: int, fwd: float = 0.01, bwd: float = 0.02, **vision) -> StepReport:
    """A step report as the link reads it off the wire."""
    return StepReport.from_wire(
        {
            "step": step,
            "loss": 1.0,
            "grad_norm": 1.0,
            "mpus": {
                "001": {"forward_s": fwd, "backward_s": bwd, **vision},
                "002": {"forward_s": 0.01, "backward_s": 0.02},
            },
        }
    )


def warm(j: JobState, gpus=None) -> int:
    n = BASELINE_SKIP + BASELINE_STEPS
    for s in range(n):
        j.apply_report(report(s), gpus or {})
    return n


def test_healthy_is_100_and_latency_against_own_baseline() -> None:
    j = job()
    s = warm(j)
    assert j.mpus["001"].health == {"forward": 100.0, "backward": 100.0}
    for k in range(5):  # forward 3x its baseline: the full 40-point latency penalty
        j.apply_report(report(s + k, fwd=0.03), {})
    assert j.mpus["001"].health == {"forward": 60.0, "backward": 100.0}
    assert j.mpus["001"].health_score == 60.0 and j.mpus["002"].health_score == 100.0


def test_checksum_terms() -> None:
    j = job()
    s = warm(j)
    j.apply_report(report(s, checksum_consecutive_failures=1, checksum_failures_total=1), {})
    assert j.mpus["001"].health["forward"] == 100 - 20 - 2
    j.apply_report(report(s + 1, checksum_consecutive_failures=2, checksum_failures_total=2), {})
    j.apply_report(report(s + 2, checksum_consecutive_failures=3, checksum_failures_total=3), {})
    assert j.mpus["001"].health["forward"] == 100 - 60 - 6  # the L1 trigger: well below 60


@pytest.mark.parametrize("health, score", [("healthy", 100.0), ("degraded", 75.0), ("failed", 0.0)])
def test_bound_gpu_health_and_memory(health: str, score: float) -> None:
    j = job()
    gpus = {3: GpuSample(index=3, uuid="GPU-3", health=health), 4: GpuSample(index=4, uuid="GPU-4")}
    warm(j, gpus)
    assert j.mpus["001"].health_score == score and j.mpus["002"].health_score == 100.0
    assert j.mpus["001"].gpu_uuid == "GPU-3"
    full = {3: GpuSample(index=3, uuid="GPU-3", memory_used_bytes=98, memory_total_bytes=100)}
    j.refresh(full)
    assert j.mpus["001"].health_score == pytest.approx(100 - 15 * (0.98 - 0.85) / 0.15)


def test_rebinding_follows_the_new_gpu() -> None:
    j = job()
    gpus = {3: GpuSample(index=3, uuid="GPU-3", health="failed"), 5: GpuSample(index=5, uuid="GPU-5")}
    s = warm(j, gpus)
    assert j.mpus["001"].health_score == 0.0
    j.apply_report(report(s, gpu=5), gpus)  # an L1 swap moved the MPU to GPU 5
    assert j.mpus["001"].gpu == 5 and j.mpus["001"].gpu_uuid == "GPU-5" and j.mpus["001"].health_score == 100.0


def test_gpus_come_from_the_gpu_probe_snapshot() -> None:
    state = AgentState(node="n")
    assert gpus_by_index(state) == {}
    state.publish(
        "gpu", GpuSnapshot(time=0.0, backend="sim", gpus=(GpuSample(index=3, uuid="GPU-3", health="failed"),))
    )
    j = job()
    warm(j, gpus_by_index(state))
    assert j.mpus["001"].health_score == 0.0 and j.mpus["001"].gpu_uuid == "GPU-3"

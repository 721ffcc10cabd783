"""The compute-density and thermal guard: a deviation counts only when sustained over the
window, the recommendation is the nearest profile, no scale-up while the GPU is hot (its
temperature read from the simulated NVML), a finding per new recommendation, and the metrics."""

from __future__ import annotations

from prometheus_client import generate_latest

from mscale.contracts.settings import ContractSection
from mscale.daemon.contract.service import ContractRecord, ContractSnapshot
from mscale.daemon.density import DensityGuard, nearest_profile
from mscale.daemon.exporters import make_registry
from mscale.daemon.mpu_state import MpuState
from mscale.daemon.state import AgentState, EventLog
from mscale.findings import Reason
from mscale.probes.gpu_sample import GpuSample
from mscale.sim.nvml import SimNvml
from mscale.sim.timeline import parse_timeline

CFG = ContractSection(density_interval_s=10, density_deviation=0.15, density_window_s=60, thermal_limit_c=70)
GB = 1e9


class Job:
    def __init__(self, gpu: int) -> None:
        self.mpus = {"001": MpuState("001", "vision", gpu)}


def record(profile: str, tflops_per_gb: float) -> ContractRecord:
    plan = {"contract_id": "0123456789ab", "compute_profile": profile, "threads": []}
    mpus = {"001": {"flops_per_step": 1.0, "achieved_flops": tflops_per_gb * 1e12, "memory_bytes": GB}}
    return ContractRecord("j1", 0, 4242, plan, 0.0, msrp={"gpus": {}, "mpus": mpus})


def guard() -> tuple[DensityGuard, EventLog]:
    events = EventLog()
    return DensityGuard(CFG, events.emit), events


def findings(events: EventLog) -> list:
    return [f for _, f in events.since(0) if f.reason is Reason.DENSITY_DEVIATION]


def test_a_deviation_becomes_a_recommendation_only_when_sustained_over_the_window() -> None:
    g, events = guard()
    jobs = {"j1": Job(0)}
    rec = record("balanced", 2.0)  # 0.6 expected: +233%
    for t in (0, 10, 50):
        (m,) = g.evaluate([rec], jobs, {}, float(t))
        assert m.since == 0.0 and not m.recommended and round(m.deviation, 3) == round((2.0 - 0.6) / 0.6, 3)
    assert not findings(events)
    (m,) = g.evaluate([rec], jobs, {}, 60.0)
    assert (m.recommended, m.direction) == ("mlvm-heavy", "up")
    (f,) = findings(events)
    assert f.labels["recommended"] == "mlvm-heavy" and f.labels["direction"] == "up" and f.labels["gpu"] == "0"
    assert "recommended profile mlvm-heavy (scale up)" in f.message
    g.evaluate([rec], jobs, {}, 70.0)
    assert len(findings(events)) == 1  # the same recommendation is not repeated


def test_a_deviation_that_lapses_starts_its_window_again() -> None:
    g, events = guard()
    jobs = {"j1": Job(0)}
    g.evaluate([record("balanced", 2.0)], jobs, {}, 0.0)
    (m,) = g.evaluate([record("balanced", 0.62)], jobs, {}, 30.0)  # +3%: within 15%
    assert m.since is None
    g.evaluate([record("balanced", 2.0)], jobs, {}, 40.0)
    (m,) = g.evaluate([record("balanced", 2.0)], jobs, {}, 90.0)
    assert not m.recommended and m.since == 40.0 and not findings(events)


def hot_gpu(celsius: float) -> GpuSample:
    """GPU 0's sample as the GPU probe would take it from the simulated NVML, after a
    temperature fault has ramped it to `celsius`."""
    now = [0.0]
    tl = parse_timeline(f"gpus: 2\nevents:\n  - {{at: 1s, gpu: 0, fault: temperature, celsius: {celsius}, ramp: 1s}}\n")
    nvml = SimNvml.from_timeline(tl, clock=lambda: now[0])
    now[0] = 5.0
    return GpuSample(index=0, uuid=nvml.uuid(0), temperature_c=float(nvml.temperature_c(0)))


def test_no_scale_up_is_recommended_while_the_gpu_is_at_or_above_the_limit() -> None:
    g, events = guard()
    jobs = {"j1": Job(0)}
    rec = record("balanced", 2.0)
    hot = {0: hot_gpu(75)}
    assert hot[0].temperature_c == 75
    g.evaluate([rec], jobs, hot, 0.0)
    (m,) = g.evaluate([rec], jobs, hot, 60.0)
    assert (m.recommended, m.direction, m.temperature_c) == ("mlvm-heavy", "hold", 75)
    (f,) = findings(events)
    assert "no scale-up while its GPU is at 75 C (contract.thermal_limit_c 70)" in f.message
    # cooled below the limit: now the scale-up is recommended, a new finding
    (m,) = g.evaluate([rec], jobs, {0: hot_gpu(69)}, 70.0)
    assert m.direction == "up" and len(findings(events)) == 2
    # exactly at the limit counts as too hot
    g2, _ = guard()
    g2.evaluate([rec], jobs, {0: hot_gpu(70)}, 0.0)
    (m,) = g2.evaluate([rec], jobs, {0: hot_gpu(70)}, 60.0)
    assert m.direction == "hold"


def test_scaling_down_is_recommended_whatever_the_temperature() -> None:
    g, events = guard()
    jobs = {"j1": Job(1)}
    rec = record("balanced", 0.19)
    g.evaluate([rec], jobs, {1: hot_gpu(90)}, 0.0)
    (m,) = g.evaluate([rec], jobs, {1: hot_gpu(90)}, 60.0)
    assert (m.recommended, m.direction) == ("audio-light", "down")
    assert nearest_profile(0.3) == "cpu-tiny" and nearest_profile(1.3) == "text-dense"


def test_the_guard_s_view_is_exported() -> None:
    g, _ = guard()
    state = AgentState(node="n")
    rec = record("balanced", 2.0)
    g.evaluate([rec], {"j1": Job(0)}, {}, 0.0)
    density = g.evaluate([rec], {"j1": Job(0)}, {}, 60.0)
    state.publish(
        "contract",
        ContractSnapshot(60.0, (rec,), extra={"density": density, "density_findings_total": g.findings_total}),
    )
    text = generate_latest(make_registry(state)).decode()
    assert (
        'mscale_density_recommendation{direction="up",gpu="0",job_id="j1",mpu_id="001",profile="balanced",'
        'rank="0",recommended="mlvm-heavy"} 1.0' in text
    )
    assert 'mscale_mpu_density_expected{job_id="j1",mpu_id="001",profile="balanced",rank="0"} 0.6' in text
    assert 'mscale_mpu_compute_density{job_id="j1",mpu_id="001",rank="0"} 2.0' in text
    assert "mscale_density_findings_total 1.0" in text

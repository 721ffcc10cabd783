"""The compute-density and thermal guard's view (mscale.daemon.density), per MPU of a job with
a contract and MSRP reports.

    mscale_mpu_density_deviation_ratio{job_id,rank,mpu_id,profile}   (measured - expected) / expected
    mscale_mpu_density_expected{job_id,rank,mpu_id,profile}          TFLOP/s per GB the profile expects
    mscale_density_recommendation{job_id,rank,mpu_id,gpu,profile,recommended,direction}
                                                                     1 while a sustained deviation
                                                                     stands (direction up, down, hold)
    mscale_density_findings_total                                    density_deviation findings made
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mscale.daemon.state import AgentState


def collect(state: AgentState) -> Iterable[Metric]:
    extra = getattr(state.snapshots.get("contract"), "extra", {}) or {}
    labels = ["job_id", "rank", "mpu_id", "profile"]
    deviation = GaugeMetricFamily(
        "mscale_mpu_density_deviation_ratio",
        "relative deviation of the MPU's compute density from its contract's profile, (measured - expected) / expected",
        labels=labels,
    )
    expected = GaugeMetricFamily(
        "mscale_mpu_density_expected",
        "compute density (TFLOP/s per GB) the MPU's contract profile expects",
        labels=labels,
    )
    recommendation = GaugeMetricFamily(
        "mscale_density_recommendation",
        "1 while the MPU's density has deviated from its profile for contract.density_window_s: the profile "
        "recommended, and the direction (up, down, or hold: no scale-up while its GPU is too hot)",
        labels=["job_id", "rank", "mpu_id", "gpu", "profile", "recommended", "direction"],
    )
    findings = CounterMetricFamily("mscale_density_findings", "density_deviation findings the guard made")
    findings.add_metric([], float(extra.get("density_findings_total", 0)))
    for m in extra.get("density", ()):
        key = [m.job_id, str(m.rank), m.mpu_id, m.profile]
        deviation.add_metric(key, m.deviation)
        expected.add_metric(key, m.expected)
        if m.recommended:
            gpu = "" if m.gpu is None else str(m.gpu)
            recommendation.add_metric(
                [m.job_id, str(m.rank), m.mpu_id, gpu, m.profile, m.recommended, m.direction], 1.0
            )
    yield from (deviation, expected, recommendation, findings)

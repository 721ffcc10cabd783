"""Training jobs, their ranks and MPUs, from the hook library's reports (mscale.daemon.jobs).

Per-rank series carry `rank` and `local_rank` (mscale_job_up, mscale_job_rank_step and every
MPU series: each rank's MPUs run on its own GPU); the job-level ones are aggregated on
purpose (step: the minimum over the live ranks; loss and gradient norm: the lowest rank's;
reports summed).

Every value goes through `value()`: the socket validates what jobs send, and should anything
slip past it, one job's odd number becomes NaN in its own series instead of failing the scrape.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mscale.daemon.jobs import PHASES, gpus_by_index
from mscale.daemon.jobs import sample_value as value
from mscale.daemon.state import AgentState


def collect(state: AgentState) -> Iterable[Metric]:
    expired = CounterMetricFamily(
        "mscale_jobs_expired",
        "jobs removed after socket.job_expiry_s disconnected (or early, to stay under socket.max_jobs)",
    )
    expired.add_metric([], state.jobs_expired)
    yield expired
    up = GaugeMetricFamily(
        "mscale_job_up", "1 while the rank is connected to the agent", labels=["job_id", "rank", "local_rank"]
    )
    ranks = GaugeMetricFamily("mscale_job_ranks", "ranks of the job connected to this agent", labels=["job_id"])
    rank_step = GaugeMetricFamily(
        "mscale_job_rank_step", "last step the rank reported", labels=["job_id", "rank", "local_rank"]
    )
    step = GaugeMetricFamily(
        "mscale_job_step", "last step the job reported: the minimum over its live ranks here", labels=["job_id"]
    )
    loss = GaugeMetricFamily(
        "mscale_job_loss",
        "loss the model returned in the last reported step (with an L3 term while one is in force), "
        "as the job's lowest rank here reports it",
        labels=["job_id"],
    )
    task_loss = GaugeMetricFamily(
        "mscale_job_task_loss",
        "task loss alone of the last reported step (mscale_job_loss less any L3 distillation term), "
        "as the job's lowest rank here reports it",
        labels=["job_id"],
    )
    gnorm = GaugeMetricFamily(
        "mscale_job_grad_norm",
        "global gradient norm of the last reported step (before clipping), as the lowest rank reports it",
        labels=["job_id"],
    )
    reports = CounterMetricFamily(
        "mscale_job_reports", "step reports received from the job, summed over its ranks", labels=["job_id"]
    )
    dropped = CounterMetricFamily(
        "mscale_job_reports_dropped",
        "step reports the job's ranks dropped (queue full, agent slow or down), summed",
        labels=["job_id"],
    )
    skipped = CounterMetricFamily(
        "mscale_job_steps_skipped",
        "optimizer steps skipped by the guard (the rank that skipped most)",
        labels=["job_id"],
    )
    # per job, unlike mscale_events_total: alerts on in-process detections (loss) carry job_id
    findings = CounterMetricFamily(
        "mscale_job_findings",
        "findings the job's hook library reported, by detector, reason and severity",
        labels=["job_id", "source", "reason", "severity"],
    )
    # per rank: each rank's MPUs run on its own GPU
    rk = ["job_id", "rank", "local_rank"]
    health = GaugeMetricFamily(
        "mpu_health_score",
        "MPU health 0-100 (latency vs own baseline, checksums, memory, GPU health), per rank",
        labels=[*rk, "mpu_id", "mpu", "phase"],
    )
    info = GaugeMetricFamily(
        "mscale_mpu_info",
        "MPU binding: always 1",
        labels=[*rk, "mpu_id", "mpu", "gpu", "gpu_uuid", "device", "fuse_level"],
    )
    clip = GaugeMetricFamily(
        "cmsa_clip_ratio", "share of steps whose gradients CMSA clipped, per MPU", labels=[*rk, "mpu_id"]
    )
    share = GaugeMetricFamily(
        "mscale_distill_share",
        "share of the job's loss that the L3 distillation term of this MPU took in the last reported step (0: none)",
        labels=[*rk, "mpu_id"],
    )
    mnorm = GaugeMetricFamily(
        "mscale_mpu_grad_norm", "gradient norm of the MPU in the last reported step", labels=[*rk, "mpu_id"]
    )
    lat = GaugeMetricFamily(
        "mscale_mpu_latency_seconds",
        "MPU forward/backward time in the last reported step",
        labels=[*rk, "mpu_id", "phase"],
    )
    base = GaugeMetricFamily(
        "mscale_mpu_latency_baseline_seconds",
        "the MPU's own latency baseline (median of its first steps)",
        labels=[*rk, "mpu_id", "phase"],
    )
    fails = CounterMetricFamily(
        "mscale_mpu_checksum_failures",
        "failed output checksums (ABFT, replay, non-finite)",
        labels=[*rk, "mpu_id"],
    )
    consec = GaugeMetricFamily(
        "mscale_mpu_checksum_consecutive_failures", "checksum failures in a row now", labels=[*rk, "mpu_id"]
    )
    overhead = GaugeMetricFamily(
        "mscale_guard_overhead_ratio",
        "the guard's measured cost per step (checks, replays, statistics) over the step time, smoothed",
        labels=rk,
    )
    coverage = GaugeMetricFamily(
        "mscale_checksum_coverage_ratio",
        "share of the MPU's checked layers its checksums covered in the last reported step (1 in incident mode)",
        labels=[*rk, "mpu_id"],
    )
    gap = GaugeMetricFamily(
        "mscale_checksum_max_gap_steps",
        "largest gap, in steps, between two checks of any of the MPU's layers (at most max_gap_steps)",
        labels=[*rk, "mpu_id"],
    )
    gpus = gpus_by_index(state)
    for job_id, job in sorted(state.jobs.items()):
        job.refresh(gpus)  # the bound GPU's health may have changed since the last report
        ranks.add_metric([job_id], len(job.ranks))
        step.add_metric([job_id], value(job.step))
        loss.add_metric([job_id], value(job.loss))
        task_loss.add_metric([job_id], value(job.task_loss))
        gnorm.add_metric([job_id], value(job.grad_norm))
        reports.add_metric([job_id], value(job.reports_total))
        dropped.add_metric([job_id], value(job.reports_dropped))
        skipped.add_metric([job_id], value(job.steps_skipped))
        for (source, reason, severity), n in sorted(job.findings.items()):
            findings.add_metric([job_id, source, reason, severity], value(n))
        for rank, rs in sorted(job.rank_states.items()):
            r = [job_id, str(rank), str(rs.local_rank)]
            up.add_metric(r, 1.0 if rank in job.ranks else 0.0)
            rank_step.add_metric(r, value(rs.step))
            if rs.guard_overhead_ratio == rs.guard_overhead_ratio:  # reported (not NaN)
                overhead.add_metric(r, rs.guard_overhead_ratio)
        for rs, m in job.iter_mpus():
            r = [job_id, str(rs.rank), str(rs.local_rank)]
            info.add_metric([*r, m.mpu_id, m.name, str(m.gpu), m.gpu_uuid, m.device, m.fuse_level], 1.0)
            clip.add_metric([*r, m.mpu_id], value(m.clip_ratio))
            share.add_metric([*r, m.mpu_id], value(m.distill_share))
            mnorm.add_metric([*r, m.mpu_id], value(m.grad_norm))
            fails.add_metric([*r, m.mpu_id], value(m.checksum_failures_total))
            consec.add_metric([*r, m.mpu_id], value(m.checksum_consecutive_failures))
            if m.checksum_coverage_ratio == m.checksum_coverage_ratio:  # reported (not NaN)
                coverage.add_metric([*r, m.mpu_id], m.checksum_coverage_ratio)
                gap.add_metric([*r, m.mpu_id], value(m.checksum_max_gap_steps))
            for phase in PHASES:
                health.add_metric([*r, m.mpu_id, m.name, phase], value(m.health[phase]))
                lat.add_metric([*r, m.mpu_id, phase], value(m.latency[phase].last_s))
                b = m.latency[phase].baseline_s
                if b is not None:
                    base.add_metric([*r, m.mpu_id, phase], value(b))
    yield from (
        up,
        ranks,
        rank_step,
        step,
        loss,
        task_loss,
        gnorm,
        reports,
        dropped,
        skipped,
        findings,
        health,
        info,
        clip,
        share,
        mnorm,
        lat,
        base,
        fails,
        consec,
        overhead,
        coverage,
        gap,
    )

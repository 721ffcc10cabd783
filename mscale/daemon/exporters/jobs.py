"""Training jobs, their ranks and MPUs, from the hook library's reports (mscale.daemon.jobs).

Per-rank series carry `rank` and `local_rank` (mscale_job_up, mscale_job_rank_step and every
MPU series: each rank's MPUs run on its own GPU); the job-level ones are aggregated on
purpose (step: the minimum over the live ranks; loss and gradient norm: the lowest rank's;
reports summed).

A scrape only reads: the MPU health scores are computed when a report arrives and when the
GPU probe publishes (mscale.daemon.state.AgentState.publish), not here.

Every value goes through `value()`: the socket validates what jobs send, and should anything
slip past it, one job's odd number becomes NaN in its own series instead of failing the scrape.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mscale.daemon.jobs import JobState
from mscale.daemon.jobs import sample_value as value
from mscale.daemon.mpu_state import PHASES
from mscale.daemon.state import AgentState

Family = GaugeMetricFamily | CounterMetricFamily
G, C = GaugeMetricFamily, CounterMetricFamily
JOB = ["job_id"]
RK = ["job_id", "rank", "local_rank"]  # per rank: each rank's MPUs run on its own GPU
MPU = [*RK, "mpu_id"]

# key, kind, name, help, labels: in the order a scrape shows them
FAMILIES: tuple[tuple[str, type[Family], str, str, list[str]], ...] = (
    ("up", G, "mscale_job_up", "1 while the rank is connected to the agent", RK),
    ("ranks", G, "mscale_job_ranks", "ranks of the job connected to this agent", JOB),
    ("rank_step", G, "mscale_job_rank_step", "last step the rank reported", RK),
    ("step", G, "mscale_job_step", "last step the job reported: the minimum over its live ranks here", JOB),
    (
        "loss",
        G,
        "mscale_job_loss",
        "loss the model returned in the last reported step (with an L3 term while one is in force), "
        "as the job's lowest rank here reports it",
        JOB,
    ),
    (
        "task_loss",
        G,
        "mscale_job_task_loss",
        "task loss alone of the last reported step (mscale_job_loss less any L3 distillation term), "
        "as the job's lowest rank here reports it",
        JOB,
    ),
    (
        "grad_norm",
        G,
        "mscale_job_grad_norm",
        "global gradient norm of the last reported step (before clipping), as the lowest rank reports it",
        JOB,
    ),
    ("reports", C, "mscale_job_reports", "step reports received from the job, summed over its ranks", JOB),
    (
        "dropped",
        C,
        "mscale_job_reports_dropped",
        "step reports the job's ranks dropped (queue full, agent slow or down), summed",
        JOB,
    ),
    (
        "skipped",
        C,
        "mscale_job_steps_skipped",
        "optimizer steps skipped by the guard (the rank that skipped most)",
        JOB,
    ),
    # per job, unlike mscale_events_total: alerts on in-process detections (loss) carry job_id
    (
        "findings",
        C,
        "mscale_job_findings",
        "findings the job's hook library reported, by detector, reason and severity",
        ["job_id", "source", "reason", "severity"],
    ),
    (
        "health",
        G,
        "mpu_health_score",
        "MPU health 0-100 (latency vs own baseline, checksums, memory, GPU health), per rank",
        [*MPU, "mpu", "phase"],
    ),
    (
        "info",
        G,
        "mscale_mpu_info",
        "MPU binding: always 1",
        [*MPU, "mpu", "gpu", "gpu_uuid", "device", "fuse_level"],
    ),
    ("clip", G, "cmsa_clip_ratio", "share of steps whose gradients CMSA clipped, per MPU", MPU),
    (
        "share",
        G,
        "mscale_distill_share",
        "share of the job's loss that the L3 distillation term of this MPU took in the last reported step (0: none)",
        MPU,
    ),
    ("mpu_grad_norm", G, "mscale_mpu_grad_norm", "gradient norm of the MPU in the last reported step", MPU),
    (
        "latency",
        G,
        "mscale_mpu_latency_seconds",
        "MPU forward/backward time in the last reported step",
        [*MPU, "phase"],
    ),
    (
        "baseline",
        G,
        "mscale_mpu_latency_baseline_seconds",
        "the MPU's own latency baseline (median of its first steps)",
        [*MPU, "phase"],
    ),
    ("fails", C, "mscale_mpu_checksum_failures", "failed output checksums (ABFT, replay, non-finite)", MPU),
    ("consecutive", G, "mscale_mpu_checksum_consecutive_failures", "checksum failures in a row now", MPU),
    (
        "overhead",
        G,
        "mscale_guard_overhead_ratio",
        "the guard's measured cost per step (checks, replays, statistics) over the step time, smoothed",
        RK,
    ),
    (
        "coverage",
        G,
        "mscale_checksum_coverage_ratio",
        "share of the MPU's checked layers its checksums covered in the last reported step (1 in incident mode)",
        MPU,
    ),
    (
        "gap",
        G,
        "mscale_checksum_max_gap_steps",
        "largest gap, in steps, between two checks of any of the MPU's layers (at most max_gap_steps)",
        MPU,
    ),
    (
        "replay_gap",
        G,
        "mscale_checksum_replay_gap_steps",
        "steps between two replays of the MPU's forward at its budget: the bound for a fault outside "
        "every linear layer (+Inf: no background replay)",
        MPU,
    ),
)


def collect(state: AgentState) -> Iterable[Metric]:
    expired = CounterMetricFamily(
        "mscale_jobs_expired",
        "jobs removed after socket.job_expiry_s disconnected (or early, to stay under socket.max_jobs)",
    )
    expired.add_metric([], state.jobs_expired)
    yield expired
    shed = CounterMetricFamily(
        "mscale_link_reports_shed",
        "report messages the agent dropped unread while behind, each superseded by a newer one of its connection",
    )
    shed.add_metric([], state.reports_shed)
    yield shed
    f: dict[str, Family] = {key: kind(name, doc, labels=labels) for key, kind, name, doc, labels in FAMILIES}
    for job_id, job in sorted(state.jobs.items()):
        _add_job(f, job_id, job)
        _add_ranks(f, job_id, job)
        _add_mpus(f, job_id, job)
    yield from f.values()


def _add_job(f: dict[str, Family], job_id: str, job: JobState) -> None:
    f["ranks"].add_metric([job_id], len(job.ranks))
    f["step"].add_metric([job_id], value(job.step))
    f["loss"].add_metric([job_id], value(job.loss))
    f["task_loss"].add_metric([job_id], value(job.task_loss))
    f["grad_norm"].add_metric([job_id], value(job.grad_norm))
    f["reports"].add_metric([job_id], value(job.reports_total))
    f["dropped"].add_metric([job_id], value(job.reports_dropped))
    f["skipped"].add_metric([job_id], value(job.steps_skipped))
    for (source, reason, severity), n in sorted(job.findings.items()):
        f["findings"].add_metric([job_id, source, reason, severity], value(n))


def _add_ranks(f: dict[str, Family], job_id: str, job: JobState) -> None:
    for rank, rs in sorted(job.rank_states.items()):
        r = [job_id, str(rank), str(rs.local_rank)]
        f["up"].add_metric(r, 1.0 if rank in job.ranks else 0.0)
        f["rank_step"].add_metric(r, value(rs.step))
        if rs.guard_overhead_ratio == rs.guard_overhead_ratio:  # reported (not NaN)
            f["overhead"].add_metric(r, rs.guard_overhead_ratio)


def _add_mpus(f: dict[str, Family], job_id: str, job: JobState) -> None:
    for rs, m in job.iter_mpus():
        r = [job_id, str(rs.rank), str(rs.local_rank), m.mpu_id]
        f["info"].add_metric([*r, m.name, str(m.gpu), m.gpu_uuid, m.device, m.fuse_level], 1.0)
        f["clip"].add_metric(r, value(m.clip_ratio))
        f["share"].add_metric(r, value(m.distill_share))
        f["mpu_grad_norm"].add_metric(r, value(m.grad_norm))
        f["fails"].add_metric(r, value(m.checksum_failures_total))
        f["consecutive"].add_metric(r, value(m.checksum_consecutive_failures))
        if m.checksum_coverage_ratio == m.checksum_coverage_ratio:  # reported (not NaN)
            f["coverage"].add_metric(r, m.checksum_coverage_ratio)
            f["gap"].add_metric(r, value(m.checksum_max_gap_steps))
        if m.checksum_replay_gap_steps == m.checksum_replay_gap_steps:
            f["replay_gap"].add_metric(r, m.checksum_replay_gap_steps)
        for phase in PHASES:
            f["health"].add_metric([*r, m.name, phase], value(m.health[phase]))
            f["latency"].add_metric([*r, phase], value(m.latency[phase].last_s))
            b = m.latency[phase].baseline_s
            if b is not None:
                f["baseline"].add_metric([*r, phase], value(b))

"""Recording rules: what alerts and dashboards share. Names follow level:metric:operation;
the window in a name comes from params.yaml (`$rate`, `$event`, `$band`)."""

from __future__ import annotations

from dataclasses import dataclass

from mscale.rules.alerts import mpu_with_gpu


@dataclass(frozen=True)
class Record:
    name: str
    expr: str


def new_or_increase(counter: str) -> str:
    """Increase of a counter over the event window that also counts a series born inside it.

    Counters of rare events (Xid codes) only appear with their first error, at value 1, and
    increase() cannot see a rise it has no earlier sample for. A series absent a window ago
    counts with its whole value."""
    sel = f"{counter}{{$agent}}"
    return f"({sel} unless {sel} offset $event) or increase({sel}[$event])"


RECORDS: tuple[Record, ...] = (
    Record("gpu:mscale_gpu_xid_errors:increase$event", new_or_increase("mscale_gpu_xid_errors_total")),
    Record("gpu:mscale_gpu_ecc_errors:increase$event", new_or_increase("mscale_gpu_ecc_errors_total")),
    Record("job_mpu:mpu_health_score:min", mpu_with_gpu("min without (phase) (mpu_health_score{$agent})")),
    Record(
        "job:mscale_cuda_kernel_launches:rate$rate",
        "sum without (pid) (rate(mscale_cuda_kernel_launches_total{$agent}[$rate]))",
    ),
    Record("job:mscale_job_loss:avg$band", "avg_over_time(mscale_job_loss{$agent}[$band])"),
    Record("job:mscale_job_loss:stddev$band", "stddev_over_time(mscale_job_loss{$agent}[$band])"),
    # Slow ranks and slow MPUs across nodes (mscale.daemon.stragglers compares the ranks on one
    # node): each rank's median time over the window, over the median of the job's ranks
    Record(
        "job_rank_mpu:mscale_mpu_latency_seconds:median$straggler",
        "quantile_over_time(0.5, mscale_mpu_latency_seconds{$agent}[$straggler])",
    ),
    Record(
        "job_rank_mpu:mscale_mpu_latency:ratio_to_job_median",
        "job_rank_mpu:mscale_mpu_latency_seconds:median$straggler"
        " / on (job_id, mpu_id, phase) group_left ()"
        " quantile by (job_id, mpu_id, phase) (0.5, job_rank_mpu:mscale_mpu_latency_seconds:median$straggler)",
    ),
    Record(
        "job_rank:mscale_job_rank_compute_seconds:median$straggler",
        "quantile_over_time(0.5, mscale_job_rank_compute_seconds{$agent}[$straggler])",
    ),
    Record(
        "job_rank:mscale_job_rank_compute:ratio_to_job_median",
        "job_rank:mscale_job_rank_compute_seconds:median$straggler"
        " / on (job_id) group_left ()"
        " quantile by (job_id) (0.5, job_rank:mscale_job_rank_compute_seconds:median$straggler)",
    ),
    # Goodput: the share of the jobs' wall time in productive steps (mscale.hook.core.goodput),
    # per job and over the cluster; badput by cause for the stacked panel
    Record(
        "job:mscale_job_goodput:ratio_rate$rate",
        "sum by (job_id) (rate(mscale_job_goodput_seconds_total{$agent}[$rate]))"
        " / (sum by (job_id) (rate(mscale_job_goodput_seconds_total{$agent}[$rate]))"
        " + sum by (job_id) (rate(mscale_job_badput_seconds_total{$agent}[$rate])))",
    ),
    Record(
        "cluster:mscale_job_goodput:ratio_rate$rate",
        "sum (rate(mscale_job_goodput_seconds_total{$agent}[$rate]))"
        " / (sum (rate(mscale_job_goodput_seconds_total{$agent}[$rate]))"
        " + sum (rate(mscale_job_badput_seconds_total{$agent}[$rate])))",
    ),
    Record(
        "job_cause:mscale_job_badput_seconds:rate$rate",
        "sum by (job_id, cause) (rate(mscale_job_badput_seconds_total{$agent}[$rate]))",
    ),
    # every finding per node, source and reason (the healing dashboard)
    Record("node:mscale_events:increase$event", f"sum without (severity) ({new_or_increase('mscale_events_total')})"),
    # the jobs' own findings (loss spikes, NaN, ...) per job, source and reason: the loss alerts read these
    Record(
        "job:mscale_job_findings:increase$event",
        f"sum without (severity) ({new_or_increase('mscale_job_findings_total')})",
    ),
    Record(
        "node:mscale_heal_actions:increase$event",
        "sum by (node, level, action, result) (increase(mscale_heal_actions_total{$agent}[$event]))",
    ),
    # Cluster views (one Prometheus per cluster; federation or remote-write adds a `cluster`
    # external label, docs/kubernetes.md). GPUs per health state, per node and per cluster:
    Record("node:mscale_gpus:count", "sum by (node, state) (mscale_gpu_health{$agent})"),
    Record("cluster:mscale_gpus:count", "sum by (state) (mscale_gpu_health{$agent})"),
    Record(
        "cluster:mscale_gpus_healthy:ratio",
        'sum(mscale_gpu_health{$agent,state="healthy"}) / count(mscale_gpu_health{$agent,state="healthy"})',
    ),
    # per job: the GPUs its MPUs run on that are not healthy (0 when all are)
    Record(
        "job:mscale_gpus_unhealthy:count",
        "count by (job_id) ("
        "  count by (job_id, node, gpu_uuid) (mscale_mpu_info{$agent})"
        '  * on (node, gpu_uuid) group_left () (mscale_gpu_health{$agent,state="healthy"} == 0)'
        ") or (count by (job_id) (mscale_mpu_info{$agent}) * 0)",
    ),
    # fuse level: a job's highest over its MPUs and nodes; jobs per level in the cluster
    Record("job:mscale_fuse_level:max", "max by (job_id) (mscale_fuse_level{$agent})"),
    Record(
        "cluster:mscale_jobs:count_by_fuse_level",
        'count_values("fuse_level", max by (job_id) (mscale_fuse_level{$agent}))',
    ),
    # snapshot freshness: seconds since a job's newest snapshot (any rank), the cluster's worst,
    # and how many jobs are older than MscaleSnapshotStale's max_age_s
    Record(
        "job:mscale_snapshot_age:seconds",
        "time() - max by (job_id) (mscale_snapshot_last_success_timestamp_seconds{$agent} > 0)",
    ),
    Record(
        "cluster:mscale_snapshot_age_seconds:max",
        "max(time() - max by (job_id) (mscale_snapshot_last_success_timestamp_seconds{$agent} > 0))",
    ),
    Record(
        "cluster:mscale_jobs_snapshot_stale:count",
        "count((time() - max by (job_id) (mscale_snapshot_last_success_timestamp_seconds{$agent} > 0))"
        " > $snapshot_max_age_s) or vector(0)",
    ),
)

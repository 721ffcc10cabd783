"""Snapshot metrics per training job, from the snapshot engine's findings in the job's reports
(mscale.daemon.jobs.SnapshotStats; the engine runs in the training process).

    mscale_snapshot_failures_total{job_id}                   0 for every registered job until one fails
    mscale_snapshot_last_success_timestamp_seconds{job_id}   after the job's first disk snapshot
    mscale_snapshot_duration_seconds{job_id}                 histogram of disk snapshot writes
    mscale_snapshot_size_bytes{job_id}                       bytes of the last disk snapshot
    checkpoint_recovery_time_seconds{job_id,tag}             last restore, tag memory (rollback), node, peer or disk
    mscale_snapshot_tier_step{job_id,tier}                   the newest step written to a tier (node, peer, disk)
    mscale_snapshot_tier_timestamp_seconds{job_id,tier}      ... when it was written (its age: time() - this)
    mscale_snapshot_tier_size_bytes{job_id,tier}             ... its size
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from mscale.daemon.jobs import SNAPSHOT_BUCKETS_S
from mscale.daemon.jobs import sample_value as value
from mscale.daemon.state import AgentState


def collect(state: AgentState) -> Iterable[Metric]:
    failures = CounterMetricFamily(
        "mscale_snapshot_failures",
        "snapshots the job failed to write, or refused on load (manifest check)",
        labels=["job_id"],
    )
    last = GaugeMetricFamily(
        "mscale_snapshot_last_success_timestamp_seconds",
        "Unix time the job's last disk snapshot was written",
        labels=["job_id"],
    )
    duration = HistogramMetricFamily(
        "mscale_snapshot_duration_seconds",
        "time to write a disk snapshot (in the background: training does not wait for it)",
        labels=["job_id"],
    )
    size = GaugeMetricFamily("mscale_snapshot_size_bytes", "size of the job's last disk snapshot", labels=["job_id"])
    recovery = GaugeMetricFamily(
        "checkpoint_recovery_time_seconds",
        "time the job's last restore took, by where the snapshot came from (memory: in-process rollback, disk: resume)",
        labels=["job_id", "tag"],
    )
    tier_step = GaugeMetricFamily(
        "mscale_snapshot_tier_step",
        "the newest step the job wrote (hashed) to a snapshot tier (node: /dev/shm, peer: a replica landed, verified, on another node, disk)",
        labels=["job_id", "tier"],
    )
    tier_time = GaugeMetricFamily(
        "mscale_snapshot_tier_timestamp_seconds",
        "Unix time the newest snapshot of the tier was written (its age: time() minus this)",
        labels=["job_id", "tier"],
    )
    tier_size = GaugeMetricFamily(
        "mscale_snapshot_tier_size_bytes", "size of the tier's newest snapshot", labels=["job_id", "tier"]
    )
    for job_id, job in sorted(state.jobs.items()):
        s = job.snapshots
        # a counter from 0, so that increase() sees the first failure
        failures.add_metric([job_id], value(s.failures))
        if s.last_success_time is not None:
            last.add_metric([job_id], value(s.last_success_time))
        if s.last_size_bytes is not None:
            size.add_metric([job_id], value(s.last_size_bytes))
        if s.writes:
            buckets = [(repr(le), n) for le, n in zip(SNAPSHOT_BUCKETS_S, s.bucket_counts, strict=True)] + [
                ("+Inf", s.writes)
            ]
            duration.add_metric([job_id], buckets, value(s.seconds_total))
        for tag, seconds in sorted(s.recovery_seconds.items()):
            recovery.add_metric([job_id, tag], value(seconds))
        for tier, (step, at, nbytes) in sorted(s.tiers.items()):
            tier_step.add_metric([job_id, tier], value(step))
            tier_time.add_metric([job_id, tier], value(at))
            tier_size.add_metric([job_id, tier], value(nbytes))
    yield from (failures, last, duration, size, recovery, tier_step, tier_time, tier_size)

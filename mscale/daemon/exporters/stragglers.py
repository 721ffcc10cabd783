"""Slow ranks and slow MPUs (mscale.daemon.stragglers): each rank's figures against the
job's other ranks on this node, and the per-rank series Prometheus compares across nodes.

    mscale_job_rank_compute_seconds{job_id,rank,local_rank}     the rank's MPUs' forward +
                                                                 backward time, last step
    mscale_straggler_ratio{job_id,rank,local_rank,mpu_id,mpu,phase}
                                                                 median over the window of the
                                                                 figure / the other ranks' median
    mscale_straggler{job_id,rank,local_rank,mpu_id,mpu,phase,gpu,gpu_uuid}
                                                                 1 while the figure is a straggler
    mscale_straggler_findings_total                              straggler findings made
    mscale_straggler_steps_compared_total                        steps compared across ranks

phase: compute (the rank's, mpu_id ""), forward or backward (the MPU's). The scrape adds `node`.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mscale.daemon.jobs import sample_value as value
from mscale.daemon.state import AgentState
from mscale.daemon.stragglers import SOURCE, StragglerView


def collect(state: AgentState) -> Iterable[Metric]:
    compute = GaugeMetricFamily(
        "mscale_job_rank_compute_seconds",
        "the rank's compute time in the last reported step: its MPUs' forward + backward seconds",
        labels=["job_id", "rank", "local_rank"],
    )
    for job_id, job in sorted(state.jobs.items()):
        for rank, rs in sorted(job.rank_states.items()):
            total = sum(m.latency[p].last_s for m in rs.mpus.values() for p in ("forward", "backward"))
            if total > 0:
                compute.add_metric([job_id, str(rank), str(rs.local_rank)], value(total))
    yield compute
    watch = state.snapshots.get(SOURCE)
    view = watch.view() if watch is not None else StragglerView()
    fig = ["job_id", "rank", "local_rank", "mpu_id", "mpu", "phase"]
    ratio = GaugeMetricFamily(
        "mscale_straggler_ratio",
        "median over stragglers.window_steps of the figure over the median of the job's other ranks here",
        labels=fig,
    )
    flag = GaugeMetricFamily(
        "mscale_straggler",
        "1 while the rank (phase compute) or its MPU (forward, backward) is a straggler, 0 when not",
        labels=[*fig, "gpu", "gpu_uuid"],
    )
    for s in view.figures:
        key = [s.job_id, str(s.rank), str(s.local_rank), s.mpu_id, s.mpu, s.phase]
        ratio.add_metric(key, value(s.ratio))
        flag.add_metric([*key, s.gpu, s.gpu_uuid], 1.0 if s.straggler else 0.0)
    found = CounterMetricFamily("mscale_straggler_findings", "straggler findings the agent made")
    found.add_metric([], view.findings_total)
    compared = CounterMetricFamily(
        "mscale_straggler_steps_compared", "steps every live rank of a job reported, compared across its ranks"
    )
    compared.add_metric([], view.steps_compared)
    yield from (ratio, flag, found, compared)

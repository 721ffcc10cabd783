"""Goodput and badput per job and rank (mscale.daemon.goodput), seconds by cause:

    mscale_job_goodput_seconds_total{job_id,rank,local_rank}         productive steps
    mscale_job_badput_seconds_total{job_id,rank,local_rank,cause}    startup, snapshot, rerun,
                                                                     checks, degraded, data_wait, hang

Their sum is the rank's wall time from attach to its last reported step (mscale.hook.core.goodput).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, Metric

from mscale.daemon.goodput import SOURCE
from mscale.daemon.state import AgentState
from mscale.link import TIME_CAUSES


def collect(state: AgentState) -> Iterable[Metric]:
    good = CounterMetricFamily(
        "mscale_job_goodput_seconds",
        "seconds of the rank's wall time spent in productive training steps",
        labels=["job_id", "rank", "local_rank"],
    )
    bad = CounterMetricFamily(
        "mscale_job_badput_seconds",
        "seconds of the rank's wall time lost, by cause (startup, snapshot, rerun, checks, degraded, data_wait, hang)",
        labels=["job_id", "rank", "local_rank", "cause"],
    )
    book = state.snapshots.get(SOURCE)
    for job_id, ranks in sorted((book.view() if book is not None else {}).items()):
        job = state.jobs.get(job_id)
        for rank, seconds in sorted(ranks.items()):
            rs = job.rank_states.get(rank) if job is not None else None
            key = [job_id, str(rank), str(rs.local_rank if rs is not None else 0)]
            good.add_metric(key, seconds.get("productive", 0.0))
            for cause in TIME_CAUSES[1:]:
                bad.add_metric([*key, cause], seconds.get(cause, 0.0))
    yield from (good, bad)

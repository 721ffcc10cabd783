"""Resource-contract compliance per job, from the agent's contract checks
(state.snapshots["contract"], mscale.daemon.contract.service).

    mscale_contract_compliant{job_id,rank,contract_id}        1 every plan thread runs on its CPUs, 0 one
                                                              does not; absent until all are seen
    mscale_contract_thread_tasks{job_id,rank,thread,state}    tasks found per plan thread, by state
                                                              (compliant, violated)
    mscale_contract_thread_present{job_id,rank,thread}        1 the thread was found, 0 not (a loader
                                                              not started)
    mscale_contract_checks_total                              compliance checks run
    mscale_contract_check_errors_total                        checks that failed or timed out
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mscale.daemon.state import AgentState


def collect(state: AgentState) -> Iterable[Metric]:
    snap = state.snapshots.get("contract")
    compliant = GaugeMetricFamily(
        "mscale_contract_compliant",
        "1 when every thread of the job's contract runs on its planned CPUs, 0 when one does not",
        labels=["job_id", "rank", "contract_id"],
    )
    tasks = GaugeMetricFamily(
        "mscale_contract_thread_tasks",
        "tasks (threads) of a contract's named I/O thread or data-loader workers, by compliance state",
        labels=["job_id", "rank", "thread", "state"],
    )
    present = GaugeMetricFamily(
        "mscale_contract_thread_present",
        "1 when the contract's named thread or its workers were found in /proc, 0 when not",
        labels=["job_id", "rank", "thread"],
    )
    checks = CounterMetricFamily("mscale_contract_checks", "contract compliance checks the agent ran")
    errors = CounterMetricFamily(
        "mscale_contract_check_errors", "contract compliance checks that failed or ran past contract.check_timeout_s"
    )
    checks.add_metric([], float(getattr(snap, "checks_total", 0)))
    errors.add_metric([], float(getattr(snap, "check_errors_total", 0)))
    for r in getattr(snap, "records", ()):
        if not r.plan.get("threads"):
            continue
        rank = str(r.rank)
        if r.compliant is not None:
            compliant.add_metric([r.job_id, rank, r.contract_id], 1.0 if r.compliant else 0.0)
        for t in r.threads:
            present.add_metric([r.job_id, rank, t.name], 0.0 if t.state == "absent" else 1.0)
            bad = len({tid for tid, _ in t.violations})
            tasks.add_metric([r.job_id, rank, t.name, "violated"], float(bad))
            tasks.add_metric([r.job_id, rank, t.name, "compliant"], float(t.tasks - bad))
    yield from (compliant, tasks, present, checks, errors)

"""Healing metrics, from the engine's latest published snapshot (state.snapshots["healing"]).

mscale_heal_actions_total{level,action,mpu_id,result}   decisions and their outcomes
mpu_drift_count_total{job_id,mpu_id}                    L1 moves of an MPU to a standby
mscale_fuse_level{job_id,mpu_id}                        fuse level in force: 0 none, 1-3
mscale_fuse_state{job_id,mpu_id,state}                  1 for the MPU's state-machine state
mscale_lr_cooling{job_id}                               1 while the job's LR is cooled, else 0
                                                        (every registered job)
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mscale.daemon.state import AgentState
from mscale.healing.books import HealingSnapshot
from mscale.healing.fsm import Level


def families(snap: HealingSnapshot, jobs: Iterable[str] = ()) -> Iterable[Metric]:
    acts = CounterMetricFamily(
        "mscale_heal_actions",
        "healing decisions by fuse level, action, MPU and result "
        "(applied, sent, noop, duplicate, rate_limited, disabled, failed, ended)",
        labels=["level", "action", "mpu_id", "result"],
    )
    for (fuse, action, mpu_id, result), n in snap.actions:
        acts.add_metric([fuse, action, mpu_id, result], n)
    yield acts
    drift = CounterMetricFamily(
        "mpu_drift_count", "moves of an MPU to a standby device (L1 swaps)", labels=["job_id", "mpu_id"]
    )
    for (job_id, mpu_id), n in snap.drift:
        drift.add_metric([job_id, mpu_id], n)
    yield drift
    level = GaugeMetricFamily(
        "mscale_fuse_level",
        "fuse level in force for the MPU: 0 none, 1 swapped, 2 degraded, 3 distilling",
        labels=["job_id", "mpu_id"],
    )
    state = GaugeMetricFamily(
        "mscale_fuse_state", "1 for the MPU's current fuse state", labels=["job_id", "mpu_id", "state"]
    )
    for job_id, mpu_id, st in snap.levels:
        lv = Level(st)
        level.add_metric([job_id, mpu_id], lv.number)
        for each in Level:
            state.add_metric([job_id, mpu_id, each.value], 1.0 if each is lv else 0.0)
    yield level
    yield state
    cooling = GaugeMetricFamily(
        "mscale_lr_cooling", "1 while the job's learning rate is cooled after a loss spike", labels=["job_id"]
    )
    cooled = set(snap.cooling) if snap is not None else set()
    for job_id in sorted(cooled | set(jobs)):  # 0 too: "not cooled" is data, not its absence
        cooling.add_metric([job_id], 1.0 if job_id in cooled else 0.0)
    yield cooling


def collect(state: AgentState) -> Iterable[Metric]:
    snap = state.snapshots.get("healing")
    if snap is None:
        return ()
    return families(snap, state.jobs)

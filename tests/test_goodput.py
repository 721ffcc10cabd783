"""Goodput and badput (mscale.hook.core.goodput): the tiny model with the demo's five faults, and a
hang; the causes add up to the run's wall time and each fault's cost is under its cause."""

from __future__ import annotations

import pytest

from mscale.demo.scenario import Fault, RunConfig, run
from mscale.link import TIME_CAUSES

# the demo's five faults (mscale/demo/faults.py script) as the job's own chaos plugin injects them,
# then a hang
FAULTS = (
    Fault(10, "corrupt", {"gpu": 0, "mode": "noise", "steps": 8}),  # SDC: replays, L1 swap
    Fault(28, "corrupt", {"mpu": "vision", "mode": "noise", "steps": 14}),  # follows it: L2, L3
    Fault(55, "loss_spike", {"factor": 25.0}),
    Fault(66, "nan_loss", {}),  # step dropped, rollback
    Fault(78, "gpu_fault", {"gpu": 1, "mode": "noise"}),  # the aligner's GPU fails
    Fault(90, "hang", {"seconds": 1.5}),
)
TOLERANCE_S = 0.05  # and 2% of the run: the run's clock starts a little before the accountant's


@pytest.mark.slow
def test_the_demo_faults_cost_shows_under_each_cause_and_the_causes_add_up() -> None:
    clean = run(RunConfig(steps=40, memory_every=5))
    r = run(RunConfig(steps=100, faults=FAULTS, memory_every=5))
    acc = r.guard.plugins[[type(p).__name__ for p in r.guard.plugins].index("GoodputAccountant")]
    t = acc.totals
    assert set(t) == set(TIME_CAUSES)
    assert r.wall_s - (TOLERANCE_S + 0.02 * r.wall_s) <= acc.wall_s <= r.wall_s
    assert acc.steps == r.steps_run  # every step run, re-runs and dropped ones included
    assert t["hang"] >= 1.4  # the 1.5 s stall, less the median step it is measured against
    assert t["rerun"] > 0  # the NaN step dropped and the steps redone after the rollback
    assert t["snapshot"] > 0  # in-memory snapshots, the rollback's restore
    assert t["checks"] > 0  # checksums, and the replays of the incident windows
    assert t["degraded"] > 0  # steps run while the vision MPU was at L2/L3
    assert t["productive"] > t["degraded"]
    # the fault-free run: no re-runs, no hang, nothing degraded
    c = clean.guard.plugins[[type(p).__name__ for p in clean.guard.plugins].index("GoodputAccountant")]
    assert c.totals["rerun"] == c.totals["hang"] == c.totals["degraded"] == 0
    assert c.totals["productive"] > 0 and c.totals["startup"] > 0


def test_the_agent_counts_each_ranks_seconds_by_cause_as_its_reports_carry_them(tmp_path) -> None:
    from support.link_agent import FEATURES, Agent, metric, wait_for

    agent = Agent(str(tmp_path / "agent.sock"), features=(*FEATURES, "mscale.daemon.goodput"))
    try:
        r = run(RunConfig(steps=12, socket_path=agent.socket_path, job_id="gp", faults=(Fault(6, "nan_loss", {}),)))
        acc = r.guard.plugins[[type(p).__name__ for p in r.guard.plugins].index("GoodputAccountant")]
        job = wait_for(lambda: agent.state.jobs.get("gp"), what="registration")
        wait_for(lambda: job.reports_total == r.steps_run, 30, "every report")
        text = agent.metrics()
        lab = 'job_id="gp",local_rank="0",rank="0"'
        counted = {"productive": metric(text, f"mscale_job_goodput_seconds_total{{{lab}}}")}
        for cause in TIME_CAUSES[1:]:
            counted[cause] = metric(text, f'mscale_job_badput_seconds_total{{cause="{cause}",{lab}}}')
        assert counted == pytest.approx(dict(acc.totals), abs=1e-6)
        assert counted["rerun"] > 0 and counted["startup"] > 0
    finally:
        agent.stop()


@pytest.mark.parametrize(
    "seconds",
    [{"idle": 1.0}, {"productive": -1.0}, {"productive": "1"}, {"hang": True}, {"checks": float("inf")}, [1.0]],
)
def test_a_report_with_bad_seconds_is_refused(seconds) -> None:
    from mscale.link import BadMessage, Report

    ok = {"type": "report", "job_id": "j", "reports": [{"step": 1, "seconds": {"productive": 0.5, "data_wait": 0}}]}
    assert Report.from_wire(ok).reports[0].seconds == {"productive": 0.5, "data_wait": 0.0}
    bad = {"type": "report", "job_id": "j", "reports": [{"step": 1, "seconds": seconds}]}
    with pytest.raises(BadMessage, match="seconds must map causes"):
        Report.from_wire(bad)

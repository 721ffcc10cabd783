"""Issue 25 item 4: labels are data. An alert label or a finding label named after a field of
the agent's own event record (source, message, seq, event, level, ...) is carried as a label:
the webhook answers 200 and its action still reaches the job; a job's finding with such labels
is taken, not refused as an internal error. A real agent, a real job, real HTTP."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import structlog

from mscale.demo.embedded import EmbeddedAgent
from mscale.demo.scenario import Run, RunConfig
from mscale.findings import Finding, Reason, Severity
from mscale.healing import policy
from support.link_agent import Agent, RawLink, wait_for

FIXTURE = Path(__file__).parent / "fixtures" / "webhook" / "xid79_firing.json"
# every field of an event record: the API's (seq + Finding.to_dict()) and the log line's own
# (structlog's event, level and timestamp)
EVENT_FIELDS = sorted({"seq", *Finding("x", Reason.PROBE_UP, Severity.INFO).to_dict(), "event", "level", "timestamp"})
POLICY_ALERTS = sorted({name for rule in policy.load().rules for name in rule.alerts})


def field_labels() -> dict[str, str]:
    return {name: f"label {name} \x1b[0m\u202e" for name in EVENT_FIELDS if name != "severity"}


@pytest.fixture(scope="module")
def agent():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    with EmbeddedAgent(healing={"lr_cool_steps": 1000}) as a:
        yield a
    structlog.reset_defaults()


def test_the_policy_has_alerts_to_post() -> None:
    assert {"MscaleGpuFatalXid", "MscaleLossSpike", "MscaleTrainingHang"} <= set(POLICY_ALERTS)


@pytest.mark.parametrize("status", ["firing", "resolved"])
@pytest.mark.parametrize("alertname", POLICY_ALERTS)
def test_every_policy_alert_with_labels_named_after_every_event_field_is_taken(agent, alertname, status) -> None:
    labels = {"alertname": alertname, "severity": "critical", "job_id": "nobody", **field_labels()}
    alert = {"status": status, "labels": labels, "startsAt": "2026-12-01T00:00:00Z", "fingerprint": alertname}
    body = {"version": "4", "status": status, "receiver": "mscale-p0", "alerts": [alert]}
    code, reply = agent.post("/api/v1/alerts", body, token=agent.token)
    assert code == 200, reply
    assert reply[status] == 1
    reason = "alert_firing" if status == "firing" else "alert_resolved"
    got = [e for e in agent.events() if e["reason"] == reason and e["labels"].get("alertname") == alertname]
    assert got and got[-1]["labels"] == labels  # every label kept, as sent
    assert got[-1]["source"] == "webhook" and got[-1]["message"] == f"alert {alertname} {status}"


def test_a_fatal_xid_alert_with_a_source_label_still_reaches_the_job(agent) -> None:
    # the case: MscaleGpuFatalXid with a `source` label was answered 500, its actions lost
    job = Run(RunConfig(steps=50, socket_path=agent.socket_path, job_id="hooked"))
    try:
        agent.wait_for(
            lambda evs: any(e["reason"] == "job_registered" and e["labels"].get("job_id") == "hooked" for e in evs)
        )
        body = json.loads(FIXTURE.read_text())
        body["alerts"][0]["labels"].update(source="node-exporter", message="hi", seq="1", event="x", level="info")
        code, reply = agent.post("/api/v1/alerts", copy.deepcopy(body), token=agent.token)
        assert code == 200, reply
        assert {a["action"] for a in reply["actions"]} == {"emergency_snapshot", "quarantine_gpu", "l1_swap"}
        assert all(a["result"] == "sent" and a["job_id"] == "hooked" for a in reply["actions"])
        for _ in range(200):  # bounded: the commands land at a step boundary
            if job.guard.mpu("vision").gpu != 0:
                break
            job.one_step()
        assert job.guard.mpu("vision").gpu != 0, "the l1_swap never reached the job"
    finally:
        job.close()


def test_a_finding_with_labels_named_after_event_fields_is_taken(tmp_path: Path) -> None:
    # the case: labels source, message, seq or event were refused as an internal TypeError
    sock = str(tmp_path / "run" / "agent.sock")
    agent = Agent(sock)
    raw = RawLink(sock)
    try:
        mpus = [{"mpu_id": "001", "name": "text", "gpu": 0}]
        reg = {"type": "register", "job_id": "j", "rank": 0, "pid": 1, "step": 0, "mpus": mpus}
        assert json.loads(raw.ask(json.dumps(reg)))["type"] == "registered"
        labels = field_labels()
        finding = Finding("loss", Reason.LOSS_SPIKE_WARN, Severity.WARNING, "spike", labels).to_dict()
        report = {"type": "report", "job_id": "j", "dropped": 0, "reports": [{"step": 1, "findings": [finding]}]}
        raw.send(json.dumps(report))
        wait_for(lambda: agent.state.jobs["j"].step == 1, what="the report")
        got = [f for _, f in agent.state.events.since(0) if f.reason is Reason.LOSS_SPIKE_WARN]
        assert len(got) == 1 and got[0].source == "hook:loss" and got[0].message == "spike"
        assert {k: got[0].labels[k] for k in labels} == labels
        assert got[0].labels["job_id"] == "j" and got[0].labels["rank"] == "0"
        assert not [k for k in agent.state.refused if k[0] == "socket"]
    finally:
        raw.close()
        agent.stop()


def test_the_job_logs_a_finding_with_such_labels_too() -> None:
    import torch

    from mscale.hook.core.attach import attach

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = attach(model, opt, job_id="j", mpus={"vision": model[0], "text": model[1]}, connect=False, cmsa=False)
    try:
        guard.emit(Finding("loss", Reason.LOSS_SPIKE_WARN, Severity.WARNING, "spike", field_labels()))
        assert guard.findings[-1].labels["source"] == "label source \x1b[0m\u202e"
    finally:
        guard.detach()

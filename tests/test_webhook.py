"""POST /api/v1/alerts on a real agent (in-process, 127.0.0.1, simulated GPUs) with a real
training job connected: an Alertmanager v4 payload acts on the job; no token, a wrong token
and malformed bodies are refused and counted; the same alert twice acts once."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import structlog

from mscale.demo.embedded import EmbeddedAgent
from mscale.demo.scenario import Run, RunConfig

FIXTURE = Path(__file__).parent / "fixtures" / "webhook" / "xid79_firing.json"


@pytest.fixture(scope="module")
def agent():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    with EmbeddedAgent(healing={"lr_cool_steps": 1000}) as a:
        yield a
    structlog.reset_defaults()


@pytest.fixture(scope="module")
def job(agent):
    r = Run(RunConfig(steps=50, socket_path=agent.socket_path, job_id="hooked"))
    agent.wait_for(
        lambda evs: any(e["reason"] == "job_registered" and e["labels"].get("job_id") == "hooked" for e in evs)
    )
    yield r
    r.close()


def step_until(job, cond, timeout=30.0):
    """Train until cond() holds: commands reach the job over its socket, at a step boundary."""
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met while training"
        job.one_step()


def train_until_reported(job, agent, predicate, timeout=30.0):
    """Train until the agent's events satisfy predicate: a finding the job made at a step
    boundary rides in a later step's report, so waiting without training can wait forever."""
    import time

    deadline = time.monotonic() + timeout
    while not (value := predicate(agent.events())):
        assert time.monotonic() < deadline, "the agent never saw the job's report"
        job.one_step()
    return value


def refused(agent, why):
    for line in agent.get("/metrics").splitlines():
        if line.startswith(f'mscale_refused_messages_total{{where="webhook",why="{why}"}}'):
            return float(line.split()[-1])
    return 0.0


def sent(agent, action):
    return [
        e
        for e in agent.events()
        if e["reason"] == "heal_action"
        and e["source"] == "healing"
        and e["labels"].get("action") == action
        and e["labels"].get("result") == "sent"
    ]


def test_payload_fixture_names_the_simulated_gpu(agent):
    body = json.loads(FIXTURE.read_text())
    assert agent.nvml.uuids[0] == body["alerts"][0]["labels"]["gpu_uuid"]


def test_refused_without_the_token_and_with_a_wrong_one(agent):
    body = json.loads(FIXTURE.read_text())
    before = refused(agent, "unauthorised")
    status, reply = agent.post("/api/v1/alerts", body)
    assert status == 401 and "missing bearer token" in reply["error"]
    status, reply = agent.post("/api/v1/alerts", body, token="not-the-token")
    assert status == 401 and "wrong bearer token" in reply["error"]
    assert refused(agent, "unauthorised") == before + 2
    assert not sent(agent, "l1_swap")  # nothing acted on


@pytest.mark.parametrize(
    "mutate,words",
    [
        (lambda b: b.update(version="3"), "version"),
        (lambda b: b.update(alerts={}), "alerts: expected a list"),
        (lambda b: b["alerts"][0].update(status="pending"), "alerts[0].status"),
        (lambda b: b["alerts"][0]["labels"].update(gpu=0), "alerts[0].labels: expected an object of strings"),
        (lambda b: b["alerts"][0]["labels"].pop("alertname"), "alertname: missing"),
    ],
)
def test_malformed_payloads_get_400_with_the_reason(agent, mutate, words):
    body = json.loads(FIXTURE.read_text())
    mutate(body)
    before = refused(agent, "malformed")
    status, reply = agent.post("/api/v1/alerts", body, token=agent.token)
    assert status == 400 and words in reply["error"]
    assert refused(agent, "malformed") == before + 1


def test_not_json_gets_400(agent):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        agent.url + "/api/v1/alerts",
        data=b"{nope",
        method="POST",
        headers={"Authorization": f"Bearer {agent.token}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and b"not JSON" in e.value.read()


def test_firing_xid_alert_acts_on_the_job_once(agent, job):
    body = json.loads(FIXTURE.read_text())
    status, reply = agent.post("/api/v1/alerts", body, token=agent.token)
    assert status == 200, reply
    assert {a["action"] for a in reply["actions"]} == {"emergency_snapshot", "quarantine_gpu", "l1_swap"}
    assert all(a["result"] == "sent" and a["job_id"] == "hooked" and a["mpu_id"] == "001" for a in reply["actions"])
    # Alertmanager repeats the firing alert: acted on once
    status, again = agent.post("/api/v1/alerts", body, token=agent.token)
    assert status == 200 and again["duplicates"] == 1 and again["actions"] == []
    # the same fault under a new fingerprint (e.g. the probe's own finding): the engine's window
    other = copy.deepcopy(body)
    other["alerts"][0]["fingerprint"] = "another"
    status, third = agent.post("/api/v1/alerts", other, token=agent.token)
    assert status == 200 and third["actions"] == []
    assert len(sent(agent, "l1_swap")) == 1
    dups = [e for e in agent.events() if e["reason"] == "heal_action" and e["labels"].get("result") == "duplicate"]
    assert len(dups) >= 2
    # the job carries the commands out at its next step: the vision MPU leaves GPU 0
    step_until(job, lambda: job.guard.mpu("vision").gpu != 0)
    train_until_reported(
        job,
        agent,
        lambda evs: [
            e
            for e in evs
            if e["source"] == "hook:fuse"
            and e["labels"].get("action") == "l1_swap"
            and e["labels"].get("result") == "applied"
        ],
    )
    assert job.guard.mpu("vision").gpu != 0 and 0 in job.fuse.states["quarantine_gpu"].gpus
    metrics = agent.get("/metrics")
    assert 'mscale_heal_actions_total{action="l1_swap",level="L1",mpu_id="001",result="sent"} 1.0' in metrics
    assert 'mscale_heal_actions_total{action="l1_swap",level="L1",mpu_id="001",result="applied"} 1.0' in metrics


def test_loss_spike_alert_cools_and_its_resolution_ends_the_window(agent, job):
    alert = {
        "status": "firing",
        "labels": {"alertname": "MscaleLossSpike", "job_id": "hooked", "severity": "warning"},
        "annotations": {},
        "startsAt": "2026-11-30T05:00:00Z",
        "fingerprint": "spike1",
    }
    body = {"version": "4", "status": "firing", "alerts": [alert], "receiver": "mscale-p1"}
    status, reply = agent.post("/api/v1/alerts", body, token=agent.token)
    assert status == 200 and [a["action"] for a in reply["actions"]] == ["lr_cool"]
    step_until(job, lambda: job.fuse.cooling)
    train_until_reported(
        job,
        agent,
        lambda evs: [e for e in evs if e["source"] == "hook:fuse" and e["labels"].get("action") == "lr_cool"],
    )
    resolved = {
        "version": "4",
        "status": "resolved",
        "receiver": "mscale-p1",
        "alerts": [{**alert, "status": "resolved", "endsAt": "2026-11-30T05:02:00Z"}],
    }
    status, reply = agent.post("/api/v1/alerts", resolved, token=agent.token)
    assert status == 200 and reply["cooling_ended"] == 1
    step_until(job, lambda: not job.fuse.cooling)
    ended = [f for f in job.findings if f.labels.get("action") == "lr_cool" and f.labels.get("result") == "ended"]
    assert ended and "resolved" in ended[-1].message


def test_a_resolution_never_seen_firing_ends_nothing(agent, job):
    # issue 25: a resolved MscaleLossSpike that was never seen firing ended a cooling window
    def spike(status, fingerprint):
        a = {
            "status": status,
            "labels": {"alertname": "MscaleLossSpike", "job_id": "hooked", "severity": "warning"},
            "startsAt": "2026-12-01T05:00:00Z",
            "fingerprint": fingerprint,
        }
        return {"version": "4", "status": status, "receiver": "mscale-p1", "alerts": [a]}

    status, reply = agent.post("/api/v1/alerts", spike("firing", "spike-real"), token=agent.token)
    assert status == 200 and [a["action"] for a in reply["actions"]] == ["lr_cool"]
    step_until(job, lambda: job.fuse.cooling)
    status, reply = agent.post("/api/v1/alerts", spike("resolved", "spike-never-fired"), token=agent.token)
    assert status == 200 and reply["resolved"] == 1 and reply["cooling_ended"] == 0
    status, reply = agent.post("/api/v1/alerts", spike("resolved", "spike-real"), token=agent.token)
    assert status == 200 and reply["cooling_ended"] == 1
    step_until(job, lambda: not job.fuse.cooling)


def test_actions_from_alerts_are_rate_limited():
    # the budget counts actions: each alert's rule yields three, so two alerts spend six
    with EmbeddedAgent(webhook={"max_actions_per_minute": 6}) as a:

        def alert(i):
            return {
                "version": "4",
                "status": "firing",
                "receiver": "mscale-p0",
                "alerts": [
                    {
                        "status": "firing",
                        "startsAt": "2026-11-30T06:00:00Z",
                        "fingerprint": f"gpu{i}",
                        "labels": {"alertname": "MscaleGpuEccDoubleBit", "gpu": str(i), "severity": "critical"},
                    }
                ],
            }

        replies = [a.post("/api/v1/alerts", alert(i), token=a.token)[1] for i in range(3)]
        assert [r["rate_limited"] for r in replies] == [0, 0, 3]  # actions past the budget
        assert [len(r["actions"]) for r in replies] == [3, 3, 0]  # no job on those GPUs: booked as noop
        metrics = a.get("/metrics")
        assert 'mscale_refused_messages_total{where="webhook",why="rate_limited"} 3.0' in metrics
        assert 'result="rate_limited"} 1.0' in metrics

"""Issue 16, item 7: the webhook's cost does not grow with history, its books stay bounded,
a large body does not block the event loop, and the action budget counts actions.

A real agent (create_app on 127.0.0.1, port 0, simulated GPUs, the shipped policy) in the
test's own event loop, with a clock the test moves, is sent real HTTP posts. No job is
connected, so the actions decided for a GPU are booked `noop`: still actions, each one
taken from the budget (the shipped policy's gpu_fatal rule yields three per alert, in this
order: emergency_snapshot, quarantine_gpu, l1_swap)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import structlog
from aiohttp import web

from mscale.daemon import keys
from mscale.daemon.app import create_app
from mscale.demo.embedded import agent_config
from mscale.healing import policy as policymod
from mscale.healing.engine import ACTED_CAP, ALERT_TTL_S, Condition, HealingEngine, Target
from mscale.healing.ledger import Budget, Ledger
from mscale.sim.nvml import SimNvml

FIXTURE = Path(__file__).parent / "fixtures" / "webhook" / "xid79_firing.json"
GPU_FATAL = ["emergency_snapshot", "quarantine_gpu", "l1_swap"]
T0 = 1_800_000_000.0


@pytest.fixture(autouse=True)
def quiet():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    yield
    structlog.reset_defaults()


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


class Agent:
    def __init__(self, app: web.Application, url: str, token: str, session: aiohttp.ClientSession) -> None:
        self.app, self.url, self.token, self.session = app, url, token, session

    async def post(self, body: dict) -> dict:
        async with self.session.post(
            self.url + "/api/v1/alerts", json=body, headers={"Authorization": f"Bearer {self.token}"}
        ) as r:
            reply = await r.json()
            assert r.status == 200, reply
            return reply

    async def metrics(self) -> str:
        async with self.session.get(self.url + "/metrics") as r:
            return await r.text()


@contextlib.asynccontextmanager
async def agent(tmp_path: Path, clock: Clock, **webhook) -> AsyncIterator[Agent]:
    token = "t" * 32
    cfg = agent_config(socket_path=str(tmp_path / "agent.sock"), token=token, webhook=webhook)
    app = create_app(cfg, nvml=SimNvml(8), clock=clock)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        async with aiohttp.ClientSession() as session:
            yield Agent(app, f"http://{host}:{port}", token, session)
    finally:
        await runner.cleanup()


def xid(gpu: int, fingerprint: str) -> dict:
    a = json.loads(FIXTURE.read_text())["alerts"][0]
    a["labels"].update(gpu=str(gpu))
    del a["labels"]["gpu_uuid"]
    a["fingerprint"] = fingerprint
    return a


def body(*alerts: dict) -> dict:
    return {"version": "4", "status": "firing", "receiver": "mscale-p0", "alerts": list(alerts)}


def taken(reply: dict) -> list[str]:
    return [a["action"] for a in reply["actions"]]


def counted(metrics: str, prefix: str) -> float:
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(prefix))


async def test_budget_of_one_lets_one_action_of_a_three_action_alert_run(tmp_path):
    """The issue's case: budget 1 gave 3 actions. Now the first action runs, the other two are
    booked rate_limited, each counted; the alert is acted on (its repeat is a duplicate)."""
    clock = Clock()
    async with agent(tmp_path, clock, max_actions_per_minute=1) as a:
        reply = await a.post(body(xid(0, "x0")))
        assert taken(reply) == ["emergency_snapshot"] and reply["rate_limited"] == 2
        assert [r["result"] for r in reply["actions"]] == ["noop"]
        metrics = await a.metrics()
        for action in GPU_FATAL[1:]:
            assert f'mscale_heal_actions_total{{action="{action}",level=' in metrics
            assert counted(metrics, f'mscale_heal_actions_total{{action="{action}"') == 1.0
        assert 'action="quarantine_gpu",level="none",mpu_id="",result="rate_limited"} 1.0' in metrics
        assert 'action="l1_swap",level="L1",mpu_id="",result="rate_limited"} 1.0' in metrics
        assert 'action="emergency_snapshot",level="none",mpu_id="",result="noop"} 1.0' in metrics
        assert counted(metrics, 'mscale_refused_messages_total{where="webhook",why="rate_limited"}') == 2.0
        # Alertmanager repeats it: acted on already, a duplicate, nothing more taken
        again = await a.post(body(xid(0, "x0")))
        assert again["duplicates"] == 1 and taken(again) == [] and again["rate_limited"] == 0
        # another GPU's alert within the minute: nothing fits, all three booked, not marked seen
        other = await a.post(body(xid(1, "x1")))
        assert taken(other) == [] and other["rate_limited"] == 3 and other["duplicates"] == 0
        # a minute on, its repeat is not a duplicate: it acts as far as the budget allows
        clock.now += 60.0
        later = await a.post(body(xid(1, "x1")))
        assert taken(later) == ["emergency_snapshot"] and later["rate_limited"] == 2 and later["duplicates"] == 0
        metrics = await a.metrics()
        assert counted(metrics, 'mscale_refused_messages_total{where="webhook",why="rate_limited"}') == 7.0


async def test_a_partly_spent_budget_runs_the_actions_that_fit_in_policy_order(tmp_path):
    async with agent(tmp_path, Clock(), max_actions_per_minute=4) as a:
        reply = await a.post(body(xid(0, "p0"), xid(1, "p1"), xid(2, "p2")))
        assert taken(reply) == GPU_FATAL + ["emergency_snapshot"]
        assert reply["rate_limited"] == 2 + 3 and reply["firing"] == 3
        metrics = await a.metrics()
        assert counted(metrics, 'mscale_heal_actions_total{action="emergency_snapshot"') == 3.0
        assert 'action="quarantine_gpu",level="none",mpu_id="",result="rate_limited"} 2.0' in metrics
        assert 'action="l1_swap",level="L1",mpu_id="",result="rate_limited"} 2.0' in metrics
        assert 'action="emergency_snapshot",level="none",mpu_id="",result="rate_limited"} 1.0' in metrics


@pytest.mark.slow  # 17,384 alerts: about 2 s
async def test_the_seen_alerts_ledger_stays_within_its_cap_and_forgets_the_oldest(tmp_path):
    n = ACTED_CAP + 1000
    clock = Clock()

    def warning(i: int) -> dict:  # no rule acts on it: only its identity is kept
        return {
            "status": "firing",
            "labels": {"alertname": "MscaleGpuTemperatureHigh", "gpu": str(i % 8), "severity": "warning"},
            "startsAt": "2026-11-30T06:00:00Z",
            "fingerprint": f"w{i}",
        }

    async with agent(tmp_path, clock) as a:
        seen = a.app[keys.ENGINE].acted  # the engine's one dedup ledger
        for start in range(0, n, 4000):
            clock.now += 1.0
            await a.post(body(*(warning(i) for i in range(start, min(n, start + 4000)))))
            assert len(seen) <= ACTED_CAP
        assert len(seen) == ACTED_CAP and seen.evicted == n - ACTED_CAP
        assert ("alert", "w0", "2026-11-30T06:00:00Z") not in seen  # the oldest went first
        assert ("alert", f"w{n - 1}", "2026-11-30T06:00:00Z") in seen
        # and a day on, one new alert expires them all from the old end
        clock.now += ALERT_TTL_S
        await a.post(body(warning(n)))
        assert len(seen) == 1


@pytest.mark.slow  # 10,000 alerts: about 1.5 s
async def test_a_body_of_ten_thousand_alerts_lets_the_loop_serve_between_slices(tmp_path):
    """While one large body is handled, the same loop answers /healthz: an observer on the loop
    sees the body part done, and a /healthz sent then is answered before the body is."""
    total = 10_000
    alerts = [xid(i % 8, f"big{i}") for i in range(total)]
    for a_ in alerts[::2]:
        a_["labels"] = {"alertname": "MscaleGpuTemperatureHigh", "gpu": a_["labels"]["gpu"], "severity": "warning"}
    async with agent(tmp_path, Clock(), max_body_bytes=1 << 26) as a:
        counts = a.app[keys.STATE].events.counts

        def firing() -> int:
            return sum(n for (src, reason, _), n in counts.items() if src == "webhook" and reason == "alert_firing")

        post = asyncio.ensure_future(a.post(body(*alerts)))
        while firing() == 0:
            assert not post.done()
            await asyncio.sleep(0)
        mid = firing()
        assert 0 < mid < total and not post.done()
        async with a.session.get(a.url + "/healthz") as r:
            assert r.status == 200
        assert not post.done() and firing() < total  # answered while the body was still being handled
        reply = await post
        assert reply["firing"] == total and firing() == total


def test_ledger_cap_evicts_oldest_first_and_expiry_works_from_the_old_end():
    led = Ledger(cap=3, ttl_s=10.0)
    for i, t in enumerate([0.0, 1.0, 2.0, 3.0]):
        led.mark(f"k{i}", t)
    assert len(led) == 3 and "k0" not in led and led.evicted == 1
    led.mark("k1", 4.0)  # marked again: newest, so k2 is now the oldest
    led.mark("k4", 5.0)
    assert "k2" not in led and {"k1", "k3", "k4"} == {k for k in ("k1", "k3", "k4") if k in led}
    assert led.fresh("k3", 12.9) and not led.fresh("k3", 13.0)  # age checked on lookup
    led.mark("k5", 14.5)  # k3 (3.0) and k1 (4.0) expire; k4 (5.0) is live
    assert "k3" not in led and "k1" not in led and "k4" in led and len(led) == 2


def test_budget_grants_what_fits_and_refills_after_a_minute():
    b = Budget(4)
    assert b.take(3, 0.0) == 3 and b.take(3, 1.0) == 1 and b.take(1, 2.0) == 0
    assert b.take(5, 60.0) == 3  # the first grant of 3 left the window; the 1 at t=1 has not
    assert b.take(1, 61.0) == 1 and b.left(61.0) == 0


def test_engine_dedup_ledger_stays_within_its_cap_after_many_distinct_conditions():
    clock = Clock()
    engine = HealingEngine(policymod.load(""), clock=clock)
    n = ACTED_CAP + 500
    for i in range(n):
        cond = Condition(
            kind="alert", name="MscaleGpuFatalXid", labels={"gpu": str(i)}, severity="critical", time=clock.now
        )
        assert [d.action for d in engine.decide(cond, lambda rule, c: [Target(gpu=c.labels["gpu"])])] == GPU_FATAL
        assert len(engine.acted) <= ACTED_CAP
    assert len(engine.acted) == ACTED_CAP and engine.acted.evicted == 500
    # the newest is still deduplicated within the policy's window
    cond = Condition(kind="alert", name="MscaleGpuFatalXid", labels={"gpu": str(n - 1)}, severity="critical")
    assert engine.decide(cond, lambda rule, c: [Target(gpu=c.labels["gpu"])]) == []
    # past the window it acts again (the entry stays until the ledger's longer expiry)
    clock.now += engine.policy.dedup_window_s
    assert engine.decide(cond, lambda rule, c: [Target(gpu=c.labels["gpu"])])
    # past the ledger's expiry, the next condition expires the whole table from its old end
    clock.now += ALERT_TTL_S
    cond = Condition(kind="alert", name="MscaleGpuFatalXid", labels={"gpu": "fresh"}, severity="critical")
    assert engine.decide(cond, lambda rule, c: [Target(gpu=c.labels["gpu"])])
    assert len(engine.acted) == 1
    assert len(engine.recent) <= 50


def test_engine_under_a_budget_marks_a_fault_acted_only_when_an_action_ran():
    clock = Clock()
    engine = HealingEngine(policymod.load(""), clock=clock)
    cond = Condition(kind="alert", name="MscaleGpuFatalXid", labels={"gpu": "0"}, severity="critical")
    run, over = engine.decide_within(cond, lambda rule, c: [Target(gpu=0)], budget=lambda n: 0)
    assert run == [] and [d.action for d in over] == GPU_FATAL and len(engine.acted) == 0
    run, over = engine.decide_within(cond, lambda rule, c: [Target(gpu=0)], budget=lambda n: 2)
    assert [d.action for d in run] == GPU_FATAL[:2] and [d.action for d in over] == GPU_FATAL[2:]
    assert len(engine.acted) == 1  # acted on: the same fault again is a duplicate
    assert engine.decide_within(cond, lambda rule, c: [Target(gpu=0)], budget=lambda n: n) == ([], [])
    booked = {(k[1], k[3]): v for k, v in engine.actions.items()}
    assert booked[("l1_swap", "rate_limited")] == 2 and booked[("quarantine_gpu", "rate_limited")] == 1


def test_the_shipped_policy_answers_an_xid_alert_with_three_actions_in_order():
    rule = policymod.load("").match("alert", "MscaleGpuFatalXid", "critical", xid(0, "f")["labels"])
    assert rule is not None and list(rule.actions_at("healthy")) == GPU_FATAL


async def test_alerts_naming_mpus_the_engine_never_saw_add_no_fuse_state(tmp_path):
    """An alert for an MPU of a job that is not connected is booked (failed: no job), but its
    lookup keeps no per-MPU state, so many such alerts do not grow the engine's books."""
    async with agent(tmp_path, Clock(), max_actions_per_minute=100_000) as a:
        alerts = [
            {
                "status": "firing",
                "labels": {"alertname": "MscaleChecksumFailures", "job_id": "gone", "mpu_id": f"m{i}"},
                "startsAt": "2026-11-30T06:00:00Z",
                "fingerprint": f"c{i}",
            }
            for i in range(600)
        ]
        reply = await a.post(body(*alerts))
        assert [r["result"] for r in reply["actions"]] == ["failed"] * 600
        engine = a.app[keys.ENGINE]
        assert engine.mpus == {} and engine.jobs == {}
        assert "mscale_fuse_level{" not in await a.metrics()


def test_a_batch_publishes_the_engines_books_once():
    published: list = []
    clock = Clock()
    engine = HealingEngine(policymod.load(""), clock=clock, publish=published.append)
    published.clear()
    with engine.batch():
        for i in range(100):
            cond = Condition(kind="alert", name="MscaleGpuFatalXid", labels={"gpu": str(i)}, severity="critical")
            for d in engine.decide(cond, lambda rule, c: [Target(gpu=c.labels["gpu"])]):
                engine.record(d, "noop")
        assert published == []
    assert len(published) == 1 and sum(n for _, n in published[0].actions) == 300
    engine.record(d, "noop")  # outside a batch: published at once, as before
    assert len(published) == 2

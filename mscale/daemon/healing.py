"""Runs the healing engine inside the agent.

The engine subscribes to the agent's event log. Node-view conditions (GPU faults, hangs)
and the alerts the webhook hands over (`alert`) become plans, carried out as link commands to
the jobs; what a job decided in-process (checksums, loss) arrives as its own
HEAL_ACTION/FUSE_STATE events and only keeps the books (and the per-MPU state the API shows)
in step.

One way through: the service builds the node view (`node_view`: a row per job, rank and MPU
with its GPU), hands the engine the condition and the view once (`HealingEngine.plan`), and
gets back the plan: each decision with its command and the ranks it goes to. It sends them
(`carry_out`) and books every outcome in one call (`HealingEngine.book`). The engine's one
dedup ledger also holds the alert's identity: an alert that Alertmanager repeats (same
fingerprint and start) is a duplicate, a resolved one forgets its entry and ends the cooling
windows its firing started.

The per-minute action budget (`webhook.max_actions_per_minute`) counts actions, not alerts:
a firing alert whose rule yields three actions takes three. When only some fit, those run in
the policy's order and the rest are booked `rate_limited`; an alert none of whose actions fit
is not marked seen, so Alertmanager's repeat may act once the budget allows.

Bounded and O(1) per alert, however long the agent has run: the engine's ledger keeps an alert
for ALERT_TTL_S and at most ACTED_CAP entries (the oldest evicted first), expired from its old
end, never scanned; the budget keeps one entry per grant in the last minute. A body is handled
in slices of SLICE alerts or SLICE_S seconds, whichever ends first, with the event loop served
between them, so a large body (the body-size limit bounds it) never blocks /healthz, the scrape
or the socket (the webhook decodes and checks it in a worker thread).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web

from mscale.daemon import keys
from mscale.daemon.alert import Alert
from mscale.daemon.state import AgentState
from mscale.findings import Finding, Reason, Severity
from mscale.healing import policy as policymod
from mscale.healing.engine import Condition, Decision, HealingEngine, Plan, Step
from mscale.healing.ledger import Budget
from mscale.healing.target import gpu_of
from mscale.healing.view import NodeRow, NodeView
from mscale.healing.words import Result

log = structlog.get_logger("mscale.healing")
SOURCE = "healing"
SLICE = 256  # alerts of one body handled between turns of the event loop at most
# and for this long at most: a request needs several turns of the loop (accept, read, answer),
# so a turn every 256 alerts (50 ms here, more under load) kept /healthz waiting over a second
SLICE_S = 0.005
_BUDGET = web.AppKey("alert_action_budget", Budget)  # actions taken from alerts, last minute


def node_view(state: AgentState) -> NodeView:
    """The node as the engine reads it: a row per job, rank and MPU with its GPU, every job,
    and the GPU probe's index <-> UUID map."""
    gpus = {g.index: g.uuid for g in getattr(state.snapshots.get("gpu"), "gpus", ()) or ()}
    rows = tuple(
        NodeRow(job_id, rs.rank, m.mpu_id, m.name, m.gpu, m.gpu_uuid)
        for job_id, job in list(state.jobs.items())
        for rs, m in list(job.iter_mpus())
    )
    return NodeView(rows, tuple(state.jobs), gpus)


async def carry_out(app: web.Application, plan: Plan) -> list[tuple[Decision, str]]:
    """Send a plan's commands to their jobs (each to the ranks the plan names), then book
    every outcome with the engine in one call."""
    link = app.get(keys.LINK)
    outcomes: list[tuple[Step, str, str]] = []
    for step in plan.steps:
        job_id = step.decision.target.job_id
        if not job_id:
            outcomes.append((step, Result.NOOP, "no job has an MPU there"))
            continue
        if link is None:
            outcomes.append((step, Result.FAILED, "no link to jobs"))
            continue
        try:
            ok = await link.send(job_id, step.command, ranks=step.ranks)
        except Exception as e:  # a dead peer must not stop the engine; the event says why
            log.warning("heal_send_failed", job_id=job_id, error=repr(e))
            ok = False
        outcomes.append((step, Result.SENT if ok else Result.FAILED, "" if ok else "job not connected"))
    if outcomes:
        app[keys.ENGINE].book(outcomes)
    return [(step.decision, result) for step, result, _ in outcomes]


async def handle(app: web.Application, cond: Condition) -> list[tuple[Decision, str]]:
    """Decide and act on one condition the node saw (a finding)."""
    return await carry_out(app, app[keys.ENGINE].plan(cond, node_view(app[keys.STATE])))


@dataclass
class AlertOutcome:
    """What became of one alert: `result` is acted, duplicate, rate_limited (no action fitted
    the budget) or resolved; `rate_limited` counts its actions past the budget."""

    firing: bool
    result: str
    actions: list[tuple[Decision, str]] = field(default_factory=list)
    cooling_ended: int = 0  # jobs whose cooling window an end command reached
    rate_limited: int = 0


async def alerts(app: web.Application, items: Iterable[Alert], *, source: str) -> AsyncIterator[AlertOutcome]:
    """A body's alerts, in order, in slices of SLICE alerts or SLICE_S seconds with the event
    loop served between them; the engine publishes its books once a slice. Each outcome is
    yielded as it is known, not kept: 10^5 of them held to the end made the collector's full
    passes long enough to stall the loop."""
    engine: HealingEngine = app[keys.ENGINE]
    items = list(items)
    i = 0
    while i < len(items):
        if i:
            await asyncio.sleep(0)
        end = time.monotonic() + SLICE_S
        with engine.batch():
            for a in items[i : i + SLICE]:
                i += 1
                yield await alert(app, a, source=source)
                if time.monotonic() >= end:
                    break


async def alert(app: web.Application, a: Alert, *, source: str) -> AlertOutcome:
    """One Alertmanager alert, as the webhook read it: an event, then the policy's decision,
    booked."""
    engine: HealingEngine = app[keys.ENGINE]
    state, now = app[keys.STATE], app[keys.CLOCK]()
    labels, name, firing = a.labels, a.name, a.firing
    cond = Condition(kind="alert", name=name, labels=labels, source=source, severity=a.severity, time=now)
    state.events.emit(
        Finding(
            source,
            Reason.ALERT_FIRING if firing else Reason.ALERT_RESOLVED,
            Severity.INFO,
            f"alert {name} {a.status}",
            dict(labels),
            now,
        )
    )
    plan = engine.plan(cond, node_view(state), alert=a.identity, resolved=not firing, budget=app[_BUDGET])
    if not firing:
        return AlertOutcome(False, "resolved", cooling_ended=await _end(app, plan.ends))
    if plan.result in (Result.DUPLICATE, Result.RATE_LIMITED):
        return AlertOutcome(True, plan.result, rate_limited=plan.rate_limited)
    return AlertOutcome(True, "acted", await carry_out(app, plan), rate_limited=plan.rate_limited)


async def _end(app: web.Application, ends: Iterable[Step]) -> int:
    """Send end commands (a resolved alert ends the cooling windows its rule started);
    the number the jobs received."""
    link = app.get(keys.LINK)
    n = 0
    for step in ends:
        if link is not None and await link.send(step.decision.target.job_id, step.command):
            n += 1
    return n


def _mirror(state: AgentState, f: Finding) -> None:
    """Keep the per-job MPU view (fuse level, binding) in step with what the job did."""
    job = state.jobs.get(f.labels.get("job_id", ""))
    rank = f.labels.get("rank", "")
    ranks = getattr(job, "rank_states", {})
    mpus = ranks[int(rank)].mpus if rank.isdigit() and int(rank) in ranks else getattr(job, "mpus", {})
    mpu = mpus.get(f.labels.get("mpu_id", "")) if job is not None else None
    if mpu is None:
        return
    if "state" in f.labels and hasattr(mpu, "fuse_level"):
        mpu.fuse_level = f.labels["state"]
    to_gpu = gpu_of(f.labels.get("to_gpu"))
    if to_gpu is not None:  # the event of an action that moved the MPU (the link checked it)
        mpu.gpu = to_gpu
        if hasattr(mpu, "place"):
            mpu.place(mpu.gpu)


async def _consume(app: web.Application, queue: asyncio.Queue[Any]) -> None:
    engine: HealingEngine = app[keys.ENGINE]
    state = app[keys.STATE]
    while True:
        f: Finding = await queue.get()
        try:
            if f.source == SOURCE:
                continue
            if f.reason in (Reason.HEAL_ACTION, Reason.FUSE_STATE):
                engine.observe(f)
                _mirror(state, f)
                continue
            await handle(app, Condition.of(f))
        except Exception:  # one bad event must not stop healing; it is logged with its cause
            log.exception("healing_event_failed", reason=f.reason.value, source=f.source)


async def _run(app: web.Application) -> AsyncIterator[None]:
    state = app[keys.STATE]
    queue = state.events.subscribe()
    task = asyncio.create_task(_consume(app, queue), name="healing-engine")
    yield
    task.cancel()
    state.events.unsubscribe(queue)
    try:
        await task
    except asyncio.CancelledError:
        pass


def setup(app: web.Application) -> None:
    cfg = app[keys.CONFIG]
    state = app[keys.STATE]
    policy = policymod.load(cfg.healing.policy)  # PolicyError (line at fault): the agent refuses to start
    app[keys.ENGINE] = HealingEngine(
        policy,
        cfg.healing,
        source=SOURCE,
        clock=app[keys.CLOCK],
        emit=state.events.emit,
        publish=lambda snap: state.publish("healing", snap),
    )
    app[_BUDGET] = Budget(cfg.webhook.max_actions_per_minute)
    app.cleanup_ctx.append(_run)

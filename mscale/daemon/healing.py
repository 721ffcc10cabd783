"""Runs the healing engine inside the agent.

The engine subscribes to the agent's event log. Node-view conditions (GPU faults, hangs)
and the alerts the webhook hands over (`alert`) become decisions, sent to the jobs as link
commands; what a job decided in-process (checksums, loss) arrives as its own
HEAL_ACTION/FUSE_STATE events and only keeps the books (and the per-MPU state the API shows)
in step. Each condition's policy rule is matched once, here, and every outcome is booked by
the engine: an alert that Alertmanager repeats (same fingerprint and start) is a duplicate,
a resolved one forgets its dedup entry and ends the cooling windows its rule started.

The per-minute action budget (`webhook.max_actions_per_minute`) counts actions, not alerts:
a firing alert whose rule yields three actions takes three. When only some fit, those run in
the policy's order and the rest are booked `rate_limited`; an alert none of whose actions fit
is not marked seen, so Alertmanager's repeat may act once the budget allows.

Bounded and O(1) per alert, however long the agent has run: the seen-alerts ledger keeps an
alert for SEEN_TTL_S and at most SEEN_CAP of them (the oldest evicted first), expired from
its old end, never scanned; the budget keeps one entry per grant in the last minute. A body
is handled in slices of SLICE alerts or SLICE_S seconds, whichever ends first, with the event
loop served between them, so a large body (the body-size limit bounds it) never blocks
/healthz, the scrape or the socket (the webhook decodes and checks it in a worker thread).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web

from mscale.daemon import keys
from mscale.daemon.jobs import MpuState
from mscale.daemon.state import AgentState
from mscale.findings import Finding, Reason, Severity
from mscale.healing import policy as policymod
from mscale.healing.engine import Condition, Decision, HealingEngine, Target
from mscale.healing.ledger import Budget, Ledger
from mscale.healing.policy import Rule
from mscale.healing.words import Result, TargetKind

log = structlog.get_logger("mscale.healing")
SOURCE = "healing"
SEEN_CAP = 16_384  # alerts remembered as acted on; the oldest are forgotten first
SEEN_TTL_S = 86_400.0  # and for at most a day (Alertmanager repeats within repeat_interval)
SLICE = 256  # alerts of one body handled between turns of the event loop at most
# and for this long at most: a request needs several turns of the loop (accept, read, answer),
# so a turn every 256 alerts (50 ms here, more under load) kept /healthz waiting over a second
SLICE_S = 0.005
_SEEN = web.AppKey("alerts_seen", Ledger)  # (fingerprint, startsAt) -> when acted on
_BUDGET = web.AppKey("alert_action_budget", Budget)  # actions taken from alerts, last minute


def gpu_ids(state: AgentState) -> dict[str, str]:
    """GPU index (text) -> UUID, and UUID -> index, from the GPU probe's latest snapshot."""
    out: dict[str, str] = {}
    snap = state.snapshots.get("gpu")
    for g in getattr(snap, "gpus", ()) or ():
        out[str(g.index)] = g.uuid
        out[g.uuid] = str(g.index)
    return out


def _mpus(state: AgentState) -> Iterable[tuple[str, MpuState]]:
    """Every rank's MPUs (each rank's on its own GPU), by job."""
    for job_id, job in list(state.jobs.items()):
        if hasattr(job, "iter_mpus"):
            for _rs, mpu in list(job.iter_mpus()):
                yield job_id, mpu
        else:
            for mpu in list(getattr(job, "mpus", {}).values()):
                yield job_id, mpu


def target_ranks(state: AgentState, t: Target) -> list[int] | None:
    """The ranks a decision on a GPU goes to: those whose MPU is bound to it (None: every rank
    of the job, for job and MPU targets, or when no rank is known to be there)."""
    job = state.jobs.get(t.job_id)
    if job is None or not t.gpu or not hasattr(job, "iter_mpus"):
        return None
    ranks = sorted(
        {rs.rank for rs, m in job.iter_mpus() if str(m.gpu) == t.gpu and (not t.mpu_id or m.mpu_id == t.mpu_id)}
    )
    return ranks or None


def resolve_targets(state: AgentState, rule: Rule, cond: Condition) -> list[Target]:
    """What a rule acts on, from the condition's labels and the agent's jobs."""
    lab = cond.labels
    job_id = lab.get("job_id", "")
    ids = gpu_ids(state)
    if rule.target == TargetKind.GPU:
        uuid = lab.get("gpu_uuid", "") or ids.get(lab.get("gpu", ""), "")
        index = lab.get("gpu", "") or ids.get(uuid, "")
        hits = [
            Target(j, m.mpu_id, str(m.gpu), getattr(m, "gpu_uuid", "") or uuid)
            for j, m in _mpus(state)
            if (index and str(m.gpu) == index) or (uuid and getattr(m, "gpu_uuid", "") == uuid)
        ]
        if job_id:
            hits = [t for t in hits if t.job_id == job_id]
        return hits or [Target("", "", index, uuid)]
    if rule.target == TargetKind.JOB:
        jobs = [job_id] if job_id else sorted(state.jobs)
        return [Target(j) for j in jobs]
    mpu_key = lab.get("mpu_id", "") or lab.get("mpu", "")
    out = []
    for j, m in _mpus(state):
        if (not job_id or j == job_id) and mpu_key in (m.mpu_id, getattr(m, "name", "")):
            out.append(Target(j, m.mpu_id, str(m.gpu), getattr(m, "gpu_uuid", "")))
    if not out and job_id and mpu_key:
        out.append(Target(job_id, mpu_key))  # not connected: the send fails and says so
    return out


async def act(app: web.Application, decisions: list[Decision]) -> list[tuple[Decision, str]]:
    """Send decisions to their jobs; book each outcome."""
    engine: HealingEngine = app[keys.ENGINE]
    link = app.get(keys.LINK)
    done: list[tuple[Decision, str]] = []
    for d in decisions:
        if not d.target.job_id:
            engine.record(d, Result.NOOP, detail="no job has an MPU there")
            done.append((d, Result.NOOP))
            continue
        if link is None:
            engine.record(d, Result.FAILED, detail="no link to jobs")
            done.append((d, Result.FAILED))
            continue
        try:
            ok = await link.send(d.target.job_id, d.command(), ranks=target_ranks(app[keys.STATE], d.target))
        except Exception as e:  # a dead peer must not stop the engine; the event says why
            log.warning("heal_send_failed", job_id=d.target.job_id, error=repr(e))
            ok = False
        result = Result.SENT if ok else Result.FAILED
        engine.record(d, result, detail="" if ok else "job not connected")
        done.append((d, result))
    return done


async def handle(app: web.Application, cond: Condition) -> list[tuple[Decision, str]]:
    """Decide and act on one condition the node saw (a finding)."""
    engine: HealingEngine = app[keys.ENGINE]
    rule = engine.match(cond)
    if rule is None or (rule.decide == "in_process" and cond.kind == "reason"):
        return []  # nothing to do, or the job acts within the step and reports what it did
    return await act(app, engine.decide(cond, _targets(app), rule))


def _targets(app: web.Application) -> Callable[[Rule, Condition], list[Target]]:
    state = app[keys.STATE]
    return lambda rule, cond: resolve_targets(state, rule, cond)


@dataclass
class AlertOutcome:
    """What became of one alert: `result` is acted, duplicate, rate_limited (no action fitted
    the budget) or resolved; `rate_limited` counts its actions past the budget."""

    firing: bool
    result: str
    actions: list[tuple[Decision, str]] = field(default_factory=list)
    cooling_ended: int = 0  # jobs whose cooling window an end command reached
    rate_limited: int = 0


async def alerts(
    app: web.Application, items: Iterable[Mapping[str, Any]], *, source: str
) -> AsyncIterator[AlertOutcome]:
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


async def alert(app: web.Application, a: Mapping[str, Any], *, source: str) -> AlertOutcome:
    """One Alertmanager alert, as the webhook parsed it (status, labels with alertname,
    startsAt, fingerprint): an event, then the policy's decision, booked."""
    engine: HealingEngine = app[keys.ENGINE]
    state, now = app[keys.STATE], app[keys.CLOCK]()
    labels, name, firing = a["labels"], a["labels"]["alertname"], a["status"] == "firing"
    cond = Condition("alert", name, labels, source=source, severity=labels.get("severity", ""), time=now)
    state.events.emit(
        Finding(
            source,
            Reason.ALERT_FIRING if firing else Reason.ALERT_RESOLVED,
            Severity.INFO,
            f"alert {name} {a['status']}",
            labels,
            now,
        )
    )
    rule = engine.match(cond)
    seen = app[_SEEN]
    ident = (a.get("fingerprint") or json.dumps(labels, sort_keys=True), a.get("startsAt", ""))
    if not firing:
        acted_on = seen.pop(ident) is not None  # this alert's firing acted here
        ends = engine.resolve(cond, _targets(app), rule) if rule is not None else []
        # it ends only what its own firing started: a resolution never seen firing ends nothing
        return AlertOutcome(False, "resolved", cooling_ended=await _end(app, ends if acted_on else []))
    if seen.fresh(ident, now):  # Alertmanager's repeat of an alert already acted on
        engine.refuse(rule, cond, Result.DUPLICATE, "Alertmanager repeated an alert already acted on")
        return AlertOutcome(True, Result.DUPLICATE)
    run: list[Decision] = []
    over: list[Decision] = []
    if rule is not None:
        budget = app[_BUDGET]
        run, over = engine.decide_within(
            cond,
            _targets(app),
            rule,
            budget=lambda n: budget.take(n, now),
            over_why=f"action budget of {budget.per_minute}/min spent",
        )
    if over and not run:
        return AlertOutcome(True, Result.RATE_LIMITED, rate_limited=len(over))
    seen.mark(ident, now)
    return AlertOutcome(True, "acted", await act(app, run), rate_limited=len(over))


async def _end(app: web.Application, ends: list[Decision]) -> int:
    """Send end commands (a resolved alert ends the cooling windows its rule started);
    the number the jobs received."""
    link = app.get(keys.LINK)
    n = 0
    for d in ends:
        if link is not None and await link.send(d.target.job_id, d.command(end=True)):
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
    if f.labels.get("to_gpu", "").isdigit():  # the event of an action that moved the MPU
        mpu.gpu = int(f.labels["to_gpu"])


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
    app[_SEEN] = Ledger(cap=SEEN_CAP, ttl_s=SEEN_TTL_S)
    app[_BUDGET] = Budget(cfg.webhook.max_actions_per_minute)
    app.cleanup_ctx.append(_run)

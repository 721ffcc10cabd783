"""Runs the healing engine inside the agent.

The engine subscribes to the agent's event log. Node-view conditions (GPU faults, hangs)
and alerts from the webhook become decisions, sent to the jobs as link commands; what a job
decided in-process (checksums, loss) arrives as its own HEAL_ACTION/FUSE_STATE events and
only keeps the books (and the per-MPU state the API shows) in step.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Iterable

import structlog
from aiohttp import web

from mscale.daemon import keys
from mscale.daemon.state import AgentState
from mscale.findings import Finding, Reason
from mscale.healing import policy as policymod
from mscale.healing.engine import Condition, Decision, HealingEngine, Target
from mscale.healing.policy import Rule

log = structlog.get_logger("mscale.healing")
SOURCE = "healing"


def gpu_ids(state: AgentState) -> dict[str, str]:
    """GPU index (text) -> UUID, and UUID -> index, from the GPU probe's latest snapshot."""
    out: dict[str, str] = {}
    snap = state.snapshots.get("gpu")
    for g in getattr(snap, "gpus", ()) or ():
        out[str(g.index)] = g.uuid
        out[g.uuid] = str(g.index)
    return out


def _mpus(state: AgentState) -> Iterable[tuple[str, object]]:
    for job_id, job in list(state.jobs.items()):
        for mpu in list(getattr(job, "mpus", {}).values()):
            yield job_id, mpu


def resolve_targets(state: AgentState, rule: Rule, cond: Condition) -> list[Target]:
    """What a rule acts on, from the condition's labels and the agent's jobs."""
    lab = cond.labels
    job_id = lab.get("job_id", "")
    ids = gpu_ids(state)
    if rule.target == "gpu":
        uuid = lab.get("gpu_uuid", "") or ids.get(lab.get("gpu", ""), "")
        index = lab.get("gpu", "") or ids.get(uuid, "")
        hits = [Target(j, m.mpu_id, str(m.gpu), getattr(m, "gpu_uuid", "") or uuid)
                for j, m in _mpus(state)
                if (index and str(m.gpu) == index) or (uuid and getattr(m, "gpu_uuid", "") == uuid)]
        if job_id:
            hits = [t for t in hits if t.job_id == job_id]
        return hits or [Target("", "", index, uuid)]
    if rule.target == "job":
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
    done = []
    for d in decisions:
        if not d.target.job_id:
            engine.record(d, "noop", detail="no job has an MPU there")
            done.append((d, "noop"))
            continue
        if link is None:
            engine.record(d, "failed", detail="no link to jobs")
            done.append((d, "failed"))
            continue
        try:
            ok = await link.send(d.target.job_id, d.command())
        except Exception as e:  # a dead peer must not stop the engine; the event says why
            log.warning("heal_send_failed", job_id=d.target.job_id, error=repr(e))
            ok = False
        result = "sent" if ok else "failed"
        engine.record(d, result, detail="" if ok else "job not connected")
        done.append((d, result))
    return done


async def handle(app: web.Application, cond: Condition) -> list[tuple[Decision, str]]:
    """Decide and act on one condition (a finding from the node or an alert)."""
    engine: HealingEngine = app[keys.ENGINE]
    state = app[keys.STATE]
    rule = engine.policy.match(cond.kind, cond.name, cond.severity, cond.labels)
    if rule is None:
        return []
    if rule.decide == "in_process" and cond.kind == "reason":
        return []  # the job acts within the step and reports what it did
    decisions = engine.decide(cond, lambda r, c: resolve_targets(state, r, c))
    return await act(app, decisions)


async def end_cooling(app: web.Application, cond: Condition) -> int:
    """A resolved alert ends the cooling windows it started."""
    engine: HealingEngine = app[keys.ENGINE]
    state = app[keys.STATE]
    link = app.get(keys.LINK)
    ended = engine.resolve(cond, lambda r, c: resolve_targets(state, r, c))
    n = 0
    for target in ended:
        if link is not None and await link.send(target.job_id, {"type": "heal", "action": "lr_cool", "end": True,
                                                                 "reason": cond.name}):
            n += 1
    return n


def _mirror(state: AgentState, f: Finding) -> None:
    """Keep the per-job MPU view (fuse level, binding) in step with what the job did."""
    job = state.jobs.get(f.labels.get("job_id", ""))
    mpu = getattr(job, "mpus", {}).get(f.labels.get("mpu_id", "")) if job is not None else None
    if mpu is None:
        return
    if "state" in f.labels and hasattr(mpu, "fuse_level"):
        mpu.fuse_level = f.labels["state"]
    if f.labels.get("action") == "l1_swap" and f.labels.get("to_gpu", "").isdigit():
        mpu.gpu = int(f.labels["to_gpu"])


async def _consume(app: web.Application, queue: asyncio.Queue) -> None:
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
    app[keys.ENGINE] = HealingEngine(policy, cfg.healing, source=SOURCE, clock=app[keys.CLOCK],
                                     emit=state.events.emit, publish=lambda snap: state.publish("healing", snap))
    app.cleanup_ctx.append(_run)

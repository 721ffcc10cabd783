"""POST /api/v1/alerts: Alertmanager's webhook (payload version 4) into the healing engine.

Bearer token from `webhook.token` (or MSCALE_WEBHOOK_TOKEN), compared in constant time; an
empty token refuses every call. A malformed body is answered 400 with the reason and
changes nothing; every refusal is counted in `mscale_refused_messages_total{where="webhook"}`.
Firing alerts map to actions by alert name and the labels gpu_uuid / gpu, mpu_id, job_id;
resolved alerts end cooling windows. The same alert delivered twice (Alertmanager repeats
firing alerts every repeat_interval) acts once; actions are rate-limited per minute.
"""
from __future__ import annotations

import hmac
import json
import time
from collections import deque
from typing import Any

import structlog
from aiohttp import web

from mscale.daemon import keys
from mscale.findings import Finding, Reason, Severity

log = structlog.get_logger("mscale.webhook")
WHERE = "webhook"
_SEEN = web.AppKey("webhook_seen", dict)
_BUCKET = web.AppKey("webhook_bucket", deque)


class PayloadError(ValueError):
    pass


def _str_map(value: Any, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise PayloadError(f"{what}: expected an object of strings")
    return value


def parse(body: Any) -> list[dict]:
    """Validate an Alertmanager v4 payload; returns its alerts. PayloadError says why not."""
    if not isinstance(body, dict):
        raise PayloadError("body: expected a JSON object")
    if body.get("version") != "4":
        raise PayloadError(f"version: expected \"4\" (Alertmanager webhook payload), got {body.get('version')!r}")
    if body.get("status") not in ("firing", "resolved"):
        raise PayloadError(f"status: expected firing or resolved, got {body.get('status')!r}")
    alerts = body.get("alerts")
    if not isinstance(alerts, list):
        raise PayloadError("alerts: expected a list")
    out = []
    for i, a in enumerate(alerts):
        if not isinstance(a, dict):
            raise PayloadError(f"alerts[{i}]: expected an object")
        if a.get("status") not in ("firing", "resolved"):
            raise PayloadError(f"alerts[{i}].status: expected firing or resolved, got {a.get('status')!r}")
        labels = _str_map(a.get("labels"), f"alerts[{i}].labels")
        if not labels.get("alertname"):
            raise PayloadError(f"alerts[{i}].labels.alertname: missing")
        _str_map(a.get("annotations", {}), f"alerts[{i}].annotations")
        for ts in ("startsAt", "endsAt"):
            if ts in a and not isinstance(a[ts], str):
                raise PayloadError(f"alerts[{i}].{ts}: expected an RFC 3339 time string")
        out.append({"status": a["status"], "labels": labels, "startsAt": a.get("startsAt", ""),
                    "fingerprint": str(a.get("fingerprint", ""))})
    return out


def _refuse(request: web.Request, status: int, why: str, reason: str) -> web.Response:
    request.app[keys.STATE].refused[(WHERE, why)] += 1
    log.warning("webhook_refused", why=why, reason=reason, peer=request.remote)
    return web.json_response({"error": reason}, status=status)


def _authorised(request: web.Request) -> str | None:
    """None when the bearer token matches; else why not."""
    token = request.app[keys.CONFIG].webhook.token
    if not token:
        return "no webhook token configured"
    got = request.headers.get("Authorization", "")
    scheme, _, presented = got.partition(" ")
    if scheme.lower() != "bearer" or not presented:
        return "missing bearer token"
    if not hmac.compare_digest(presented.strip().encode(), token.encode()):
        return "wrong bearer token"
    return None


def _take(app: web.Application, now: float) -> bool:
    """Per-minute action budget (a sliding window of action times)."""
    bucket = app[_BUCKET]
    while bucket and now - bucket[0] >= 60.0:
        bucket.popleft()
    if len(bucket) >= app[keys.CONFIG].webhook.max_actions_per_minute:
        return False
    bucket.append(now)
    return True


def _book(app: web.Application, rule, cond, result: str, why: str) -> None:
    """An alert not acted on is still a decision: an event and a count."""
    from mscale.healing import actions
    from mscale.healing.engine import Decision, Target

    if rule is None:
        return
    first = next((a for acts in rule.actions.values() for a in acts), "")
    if not first:
        return
    lab = cond.labels
    target = Target(lab.get("job_id", ""), lab.get("mpu_id", ""), lab.get("gpu", ""), lab.get("gpu_uuid", ""))
    app[keys.ENGINE].record(Decision(rule.name, first, actions.get(first).level, target, "", cond.name, why,
                                     time=cond.time), result)


async def alerts(request: web.Request) -> web.Response:
    from mscale.daemon import healing as service
    from mscale.healing.engine import Condition

    why = _authorised(request)
    if why is not None:
        return _refuse(request, 401, "unauthorised", why)
    try:
        body = json.loads(await request.read())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return _refuse(request, 400, "malformed", f"body is not JSON: {e}")
    try:
        items = parse(body)
    except PayloadError as e:
        return _refuse(request, 400, "malformed", str(e))
    app = request.app
    state, engine, clock = app[keys.STATE], app[keys.ENGINE], app[keys.CLOCK]
    seen = app[_SEEN]
    summary = {"firing": 0, "resolved": 0, "actions": [], "duplicates": 0, "rate_limited": 0, "cooling_ended": 0}
    for a in items:
        labels, name = a["labels"], a["labels"]["alertname"]
        now = clock()
        cond = Condition("alert", name, labels, source=WHERE, severity=labels.get("severity", ""), time=now)
        firing = a["status"] == "firing"
        state.events.emit(Finding(WHERE, Reason.ALERT_FIRING if firing else Reason.ALERT_RESOLVED,
                                  Severity.INFO, f"alert {name} {a['status']}", labels, now))
        ident = (a["fingerprint"] or json.dumps(labels, sort_keys=True), a["startsAt"])
        if not firing:
            summary["resolved"] += 1
            seen.pop(ident, None)
            summary["cooling_ended"] += await service.end_cooling(app, cond)
            continue
        summary["firing"] += 1
        rule = engine.policy.match("alert", name, "", labels)
        if ident in seen:  # Alertmanager's repeat of an alert already acted on
            summary["duplicates"] += 1
            _book(app, rule, cond, "duplicate", "Alertmanager repeated an alert already acted on")
            continue
        if rule is not None and any(rule.actions.values()) and not _take(app, now):
            summary["rate_limited"] += 1
            state.refused[(WHERE, "rate_limited")] += 1
            _book(app, rule, cond, "rate_limited",
                  f"action budget of {app[keys.CONFIG].webhook.max_actions_per_minute}/min spent")
            continue
        seen[ident] = now
        for d, result in await service.handle(app, cond):
            summary["actions"].append({"action": d.action, "job_id": d.target.job_id,
                                       "mpu_id": d.target.mpu_id, "result": result})
        for k in [k for k, t in seen.items() if now - t > 86400]:
            del seen[k]
    return web.json_response(summary)


def setup(app: web.Application) -> None:
    app[_SEEN] = {}
    app[_BUCKET] = deque()
    app.router.add_post("/api/v1/alerts", alerts)

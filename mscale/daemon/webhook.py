"""POST /api/v1/alerts: Alertmanager's webhook (payload version 4) into the healing service.

This module authenticates, parses and validates; the healing service (mscale.daemon.healing)
matches each alert to the policy and books what it did. Bearer token from `webhook.token`
(or MSCALE_WEBHOOK_TOKEN), compared in constant time; an empty token refuses every call. A
malformed body is answered 400 with the reason and changes nothing; every refusal is counted
in `mscale_refused_messages_total{where="webhook"}`, an alert past the action budget too
(why="rate_limited"). Firing alerts map to actions by alert name and the labels gpu_uuid /
gpu, mpu_id, job_id; resolved alerts end cooling windows. The same alert delivered twice
(Alertmanager repeats firing alerts every repeat_interval) acts once; actions are
rate-limited per minute (`webhook.max_actions_per_minute`). The reply counts the alerts by
outcome and lists the actions taken.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

import structlog
from aiohttp import web

from mscale.daemon import healing as service
from mscale.daemon import keys

log = structlog.get_logger("mscale.webhook")
WHERE = "webhook"


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
        raise PayloadError(f'version: expected "4" (Alertmanager webhook payload), got {body.get("version")!r}')
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
        out.append(
            {
                "status": a["status"],
                "labels": labels,
                "startsAt": a.get("startsAt", ""),
                "fingerprint": str(a.get("fingerprint", "")),
            }
        )
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


async def alerts(request: web.Request) -> web.Response:
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
    summary: dict[str, Any] = {
        "firing": 0,
        "resolved": 0,
        "actions": [],
        "duplicates": 0,
        "rate_limited": 0,
        "cooling_ended": 0,
    }
    for a in items:
        out = await service.alert(request.app, a, source=WHERE)
        summary["firing" if out.firing else "resolved"] += 1
        summary["cooling_ended"] += out.cooling_ended
        if out.result == "duplicate":
            summary["duplicates"] += 1
        elif out.result == "rate_limited":
            summary["rate_limited"] += 1
            request.app[keys.STATE].refused[(WHERE, "rate_limited")] += 1
        for d, result in out.actions:
            summary["actions"].append(
                {"action": d.action, "job_id": d.target.job_id, "mpu_id": d.target.mpu_id, "result": result}
            )
    return web.json_response(summary)


def setup(app: web.Application) -> None:
    app.router.add_post("/api/v1/alerts", alerts)

"""POST /api/v1/alerts: Alertmanager's webhook (payload version 4) into the healing service.

This module authenticates, parses and validates; the healing service (mscale.daemon.healing)
matches each alert to the policy and books what it did. The rules of every state-changing
endpoint apply (mscale.daemon.access: Host/Origin naming this agent, the bearer token from
`webhook.token` or MSCALE_WEBHOOK_TOKEN compared in constant time, an empty token refusing
every call, `Content-Type: application/json`, at most `webhook.max_body_bytes`, bounded JSON). A
malformed body is answered 400 with the reason and changes nothing; every refusal is counted
in `mscale_refused_messages_total{where="webhook"}`, each action past the action budget too
(why="rate_limited"). Firing alerts map to actions by alert name and the labels gpu_uuid /
gpu, mpu_id, job_id; resolved alerts end cooling windows. The same alert delivered twice
(Alertmanager repeats firing alerts every repeat_interval) acts once; actions are
rate-limited per minute (`webhook.max_actions_per_minute`, counting actions). The reply
counts the alerts by outcome and the actions past the budget (`rate_limited`), and lists the
actions taken.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from mscale.daemon import access, keys
from mscale.daemon import healing as service
from mscale.healing.words import Result

WHERE = "webhook"


class PayloadError(ValueError):
    pass


def _str_map(value: Any, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise PayloadError(f"{what}: expected an object of strings")
    return value


def parse(body: Any) -> list[dict[str, Any]]:
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


async def alerts(request: web.Request) -> web.Response:
    cfg = request.app[keys.CONFIG]
    try:
        body = await access.json_post(
            request, token=cfg.webhook.token, what="webhook", max_bytes=cfg.webhook.max_body_bytes
        )
        items = parse(body)
    except access.Refused as e:
        return access.refuse(request, WHERE, e)
    except PayloadError as e:
        return access.refuse(request, WHERE, access.Refused(400, "malformed", str(e)))
    summary: dict[str, Any] = {
        "firing": 0,
        "resolved": 0,
        "actions": [],
        "duplicates": 0,
        "rate_limited": 0,
        "cooling_ended": 0,
    }
    for out in await service.alerts(request.app, items, source=WHERE):
        summary["firing" if out.firing else "resolved"] += 1
        summary["cooling_ended"] += out.cooling_ended
        if out.result == Result.DUPLICATE:
            summary["duplicates"] += 1
        if out.rate_limited:  # actions past the budget, each counted
            summary["rate_limited"] += out.rate_limited
            request.app[keys.STATE].refused[(WHERE, "rate_limited")] += out.rate_limited
        for d, result in out.actions:
            summary["actions"].append(
                {"action": d.action, "job_id": d.target.job_id, "mpu_id": d.target.mpu_id, "result": result}
            )
    return web.json_response(summary)


def setup(app: web.Application) -> None:
    app.router.add_post("/api/v1/alerts", alerts)

"""POST /api/v1/alerts: Alertmanager's webhook (payload version 4) into the healing service.

This module authenticates, parses and validates (each alert read once into an `Alert`,
mscale.daemon.alert); the healing service (mscale.daemon.healing)
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

import asyncio
import contextlib
import gc
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from mscale.daemon import access, keys
from mscale.daemon import healing as service
from mscale.daemon.alert import Alert, PayloadError, parse
from mscale.healing.words import Result

WHERE = "webhook"
LARGE_BODY = 1 << 20  # bytes (the default body limit) past which a body is decoded with the collector held


class _Collector:
    """The garbage collector around large bodies. Decoding 10^5 alerts makes as many objects, and
    each full pass of the collector walks them all, on the event loop's time (0.3-2 s a pass
    here): so the collector is paused while a large body is decoded (it could only find live,
    new objects), what exists then is frozen out of its passes while the alerts are handled,
    and thawed when the last large body is done and its alerts freed."""

    def __init__(self) -> None:
        self.bodies = 0

    @contextlib.contextmanager
    def held(self, size: int) -> Iterator[None]:
        if size < LARGE_BODY:
            yield
            return
        self.bodies += 1
        gc.disable()
        try:
            yield
        finally:
            self.bodies -= 1
            if self.bodies == 0:
                gc.unfreeze()
                gc.enable()

    def decoded(self) -> None:
        if self.bodies:
            gc.freeze()
            gc.enable()


_COLLECTOR = web.AppKey("webhook_collector", _Collector)


def decode(raw: bytes) -> list[Alert]:
    """The body's alerts, validated (access.parse_json, then `alert.parse`: each alert an `Alert`); run in a worker thread:
    a body at the size limit takes seconds to decode and check, and the loop serves /healthz,
    the scrape and the socket meanwhile. The decoded body is dropped on return, so only the
    alerts stay in memory (fewer objects for the collector to walk while they are handled)."""
    return parse(access.parse_json(raw, in_thread=True))


async def alerts(request: web.Request) -> web.Response:
    cfg = request.app[keys.CONFIG]
    try:
        raw = await access.checked_body(
            request, token=cfg.webhook.token, what="webhook", max_bytes=cfg.webhook.max_body_bytes
        )
    except access.Refused as e:
        return access.refuse(request, WHERE, e)
    collector = request.app[_COLLECTOR]
    with collector.held(len(raw)):
        try:
            items = await asyncio.to_thread(decode, raw)
        except access.Refused as e:
            return access.refuse(request, WHERE, e)
        except PayloadError as e:
            return access.refuse(request, WHERE, access.Refused(400, "malformed", str(e)))
        del raw
        collector.decoded()
        summary = await _handle(request, items)
        del items  # freed before the thaw: the collector's next pass does not walk them
    return web.json_response(summary)


async def _handle(request: web.Request, items: list[Alert]) -> dict[str, Any]:
    """The alerts through the healing service; the reply's summary."""
    summary: dict[str, Any] = {
        "firing": 0,
        "resolved": 0,
        "actions": [],
        "duplicates": 0,
        "rate_limited": 0,
        "cooling_ended": 0,
    }
    async for out in service.alerts(request.app, items, source=WHERE):
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
    return summary


def setup(app: web.Application) -> None:
    app[_COLLECTOR] = _Collector()
    app.router.add_post("/api/v1/alerts", alerts)

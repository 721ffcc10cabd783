"""Read-only HTTP API: /metrics (mscale.daemon.scrape), /healthz, /api/v1/{gpus,probes,events}.

The jobs, their MPUs and fuse levels are in GET /api/v1/status (mscale.daemon.status_api);
the POST routes are /api/v1/alerts (mscale.daemon.webhook) and /api/v1/chaos
(mscale.daemon.chaos). `mscale.agent_client.AgentClient` is the client of all of them.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from aiohttp import web

from mscale.daemon import keys, scrape


def to_jsonable(obj: Any) -> Any:
    """Snapshots are frozen dataclasses; render them (and enums, tuples) as JSON values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    return obj


async def healthz(request: web.Request) -> web.Response:
    state = request.app[keys.STATE]
    probes = {n: st.up for n, st in state.probe_status.items() if st.enabled}
    return web.json_response({"status": "ok", "node": state.node, "probes": probes})


async def gpus(request: web.Request) -> web.Response:
    snap = request.app[keys.STATE].snapshots.get("gpu")
    return web.json_response(to_jsonable(snap) if snap is not None else {"gpus": []})


async def probes(request: web.Request) -> web.Response:
    state = request.app[keys.STATE]
    return web.json_response({n: st.to_dict() for n, st in sorted(state.probe_status.items())})


async def events(request: web.Request) -> web.Response:
    try:
        since = int(request.query.get("since", "0"))
        limit = int(request.query.get("limit", "200"))
    except ValueError:
        raise web.HTTPBadRequest(text="since and limit must be integers") from None
    items = request.app[keys.STATE].events.since(since, max(1, min(limit, 10000)))
    return web.json_response({"events": [dict(seq=s, **f.to_dict()) for s, f in items]})


def setup(app: web.Application) -> None:
    scrape.setup(app)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/api/v1/gpus", gpus)
    app.router.add_get("/api/v1/probes", probes)
    app.router.add_get("/api/v1/events", events)

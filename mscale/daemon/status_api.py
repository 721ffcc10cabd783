"""GET /api/v1/status: one view for `mscale status` (GPUs, jobs and their ranks, each rank's
MPUs with health and fuse level, last events)."""

from __future__ import annotations

import math
from typing import Any

from aiohttp import web

from mscale.daemon import keys


def _num(v: Any) -> Any:
    """A number JSON can carry: NaN and infinities are null."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return v if ok else None


def view(app: web.Application, *, last: int = 15) -> dict[str, Any]:
    state = app[keys.STATE]
    snap = state.snapshots.get("gpu")
    gpus = [
        {"index": g.index, "uuid": g.uuid, "health": g.health, "reasons": list(g.reasons)}
        for g in getattr(snap, "gpus", ()) or ()
    ]
    heal = state.snapshots.get("healing")
    levels = {(j, m): s for j, m, s in getattr(heal, "levels", ())}
    jobs = []
    for job_id, job in sorted(state.jobs.items()):
        ranks = []
        for rank, rs in sorted(getattr(job, "rank_states", {}).items()):
            mpus = []
            for mpu_id, m in sorted(rs.mpus.items()):
                # the agent's books are per job: they speak for the lead rank; other ranks as reported
                fuse = levels.get((job_id, mpu_id), "") if rank == job.lead else ""
                mpus.append(
                    {
                        "mpu_id": mpu_id,
                        "name": m.name,
                        "gpu": m.gpu,
                        "health_score": _num(m.health_score),
                        "fuse": fuse or m.fuse_level or "healthy",
                    }
                )
            ranks.append(
                {
                    "rank": rank,
                    "local_rank": rs.local_rank,
                    "world_size": rs.world_size,
                    "pid": rs.pid,
                    "connected": rank in job.ranks,
                    "step": rs.step,
                    "loss": _num(rs.loss),
                    "mpus": mpus,
                }
            )
        jobs.append(
            {
                "job_id": job_id,
                "step": job.step,  # the minimum over its live ranks
                "loss": _num(job.loss),  # the lowest rank's
                "connected": job.connected,
                "ranks": ranks,
            }
        )
    events = [dict(seq=s, **f.to_dict()) for s, f in state.events.since(0, last)]
    return {
        "node": state.node,
        "gpus": gpus,
        "jobs": jobs,
        "cooling": list(getattr(heal, "cooling", ())),
        "events": events,
    }


async def status(request: web.Request) -> web.Response:
    try:
        last = max(1, min(int(request.query.get("events", "15")), 1000))
    except ValueError:
        raise web.HTTPBadRequest(text="events must be an integer") from None
    return web.json_response(view(request.app, last=last))


def setup(app: web.Application) -> None:
    app.router.add_get("/api/v1/status", status)

"""GET /api/v1/status: one view for `mscale status` (GPUs, jobs, MPUs, fuse, last events)."""

from __future__ import annotations

from aiohttp import web

from mscale.daemon import keys


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def view(app: web.Application, *, last: int = 15) -> dict:
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
        mpus = []
        for mpu_id, m in sorted(getattr(job, "mpus", {}).items()):
            mpus.append(
                {
                    "mpu_id": mpu_id,
                    "name": getattr(m, "name", ""),
                    "gpu": getattr(m, "gpu", None),
                    "health_score": _num(getattr(m, "health_score", None)),
                    "fuse": levels.get((job_id, mpu_id), getattr(m, "fuse_level", "") or "healthy"),
                }
            )
        jobs.append(
            {
                "job_id": job_id,
                "rank": getattr(job, "rank", 0),
                "pid": getattr(job, "pid", 0),
                "step": getattr(job, "step", None),
                "connected": getattr(job, "connected", None),
                "mpus": mpus,
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

"""The remediation hand-off (mscale.kube.remediation), started with the agent when
[remediation] enabled is set: its filers built from the config, its service run on the agent's
loop and stopped with it."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from mscale.daemon import keys
from mscale.kube.remediation.service import RemediationService, build_filers

_SERVICE = web.AppKey("remediation_service", RemediationService)


def setup(app: web.Application) -> None:
    config = app[keys.CONFIG]
    if not config.remediation.enabled:
        return
    state = app[keys.STATE]
    filers = build_filers(config, state, app[keys.CLOCK])
    app[_SERVICE] = RemediationService(state, config.remediation, filers, clock=app[keys.CLOCK])
    app.cleanup_ctx.append(_run)


async def _run(app: web.Application) -> AsyncIterator[None]:
    service = app[_SERVICE]
    await service.start()
    yield
    await service.stop()

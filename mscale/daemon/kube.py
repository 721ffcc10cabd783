"""Kubernetes (mscale.kube): started with the agent when [kubernetes] enabled is set; off
the cluster this adds nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from mscale.daemon import keys


def setup(app: web.Application) -> None:
    if app[keys.CONFIG].kubernetes.enabled:
        app.cleanup_ctx.append(_kube_service)


async def _kube_service(app: web.Application) -> AsyncIterator[None]:
    from mscale.kube.service import KubeService

    service = KubeService(app[keys.STATE], app[keys.CONFIG].kubernetes, clock=app[keys.CLOCK])
    await service.start()
    yield
    await service.stop()

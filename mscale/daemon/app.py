"""The agent as an aiohttp app factory. Tests drive `create_app` on port 0.

Feature modules (API, webhook, hook link, chaos, healing) each expose `setup(app)`, which
adds routes and, through `app.cleanup_ctx`, the services they run. The access rules of the
state-changing routes (mscale.daemon.access) are set up first; serve the app through
mscale.daemon.httpserver (`make_runner`, `LimitedSite`) for the connection limits.
"""

from __future__ import annotations

import importlib
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from mscale.daemon import access, keys
from mscale.daemon.config import Config
from mscale.daemon.exporters import make_registry
from mscale.daemon.runner import ProbeRunner
from mscale.daemon.state import AgentState, EventLog, ProbeStatus
from mscale.probes import REGISTRY as PROBE_REGISTRY
from mscale.probes import spec
from mscale.probes.base import ProbeContext, ProbeUnavailable

FEATURES: tuple[str, ...] = (
    "mscale.daemon.api",
    "mscale.daemon.webhook",
    "mscale.daemon.link",
    "mscale.daemon.stragglers",
    "mscale.daemon.goodput",
    "mscale.daemon.standby",
    "mscale.daemon.chaos",
    "mscale.daemon.status_api",
    "mscale.daemon.healing",
    "mscale.daemon.contract.service",
    "mscale.daemon.kube",
    "mscale.daemon.remediation",
)


class UnavailableProbe:
    """Stands in for a probe whose factory found it cannot run here; reports why."""

    def __init__(self, name: str, reason: str) -> None:
        self.name, self.reason = name, reason

    def sample(self) -> Any:
        raise ProbeUnavailable(self.reason)

    def close(self) -> None:
        pass


def build_probes(
    config: Config,
    ctx: ProbeContext,
    names: tuple[str, ...] | None = None,
    *,
    status: dict[str, ProbeStatus] | None = None,
) -> list[tuple[Any, float, float]]:
    """The probes named (every registered one by default), each enabled one built from `ctx`;
    `status` (the agent's state.probe_status) gets each probe's entry."""
    probes = []
    status = {} if status is None else status
    for name in names or tuple(PROBE_REGISTRY):
        section = getattr(config.probes, name)
        status[name] = ProbeStatus(name, enabled=section.enabled)
        if not section.enabled:
            continue
        try:
            probe = spec(name).factory(ctx)
        except ProbeUnavailable as e:
            probe = UnavailableProbe(name, str(e))
        except ModuleNotFoundError as e:  # an optional dependency of the probe is missing
            probe = UnavailableProbe(name, f"cannot import {e.name}")
        probes.append((probe, section.interval_s, section.timeout_s))
    return probes


def new_state(config: Config) -> AgentState:
    return AgentState(
        node=config.agent.node or config.kubernetes.node() or socket.gethostname(),
        events=EventLog(config.agent.event_history, config.agent.event_history_bytes),
    )


def create_app(
    config: Config,
    *,
    state: AgentState | None = None,
    probes: list[Any] | None = None,
    nvml: Any = None,
    clock: Callable[[], float] = time.time,
    features: tuple[str, ...] = FEATURES,
) -> web.Application:
    """Build the agent. `probes` is a list of (probe, interval_s, timeout_s); None builds
    every enabled probe from the registry."""
    state = state or new_state(config)
    app = web.Application(client_max_size=config.webhook.max_body_bytes)
    app[keys.CONFIG] = config
    app[keys.STATE] = state
    app[keys.CLOCK] = clock
    app[keys.NVML] = nvml
    if probes is None:
        ctx = ProbeContext(config=config, emit=state.events.emit, clock=clock, jobs=state.registered_jobs, nvml=nvml)
        probes = build_probes(config, ctx, status=state.probe_status)
    app[keys.PROBES] = probes
    app[keys.REGISTRY] = make_registry(state)
    app.cleanup_ctx.append(_probe_runner)
    access.setup(app)
    for module in features:
        importlib.import_module(module).setup(app)
    return app


async def _probe_runner(app: web.Application) -> AsyncIterator[None]:
    runner = ProbeRunner(app[keys.STATE], app[keys.PROBES], clock=app[keys.CLOCK])
    app[keys.RUNNER] = runner
    runner.start()
    yield
    await runner.stop()

"""Typed aiohttp application keys shared by the agent's route and service modules."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from mscale.daemon.config import Config
from mscale.daemon.state import AgentState

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from mscale.daemon.link import LinkServer
    from mscale.daemon.runner import ProbeRunner
    from mscale.healing.engine import HealingEngine
    from mscale.probes.base import Probe

CONFIG = web.AppKey("config", Config)
STATE = web.AppKey("state", AgentState)
CLOCK: web.AppKey[Callable[[], float]] = web.AppKey("clock")
NVML: web.AppKey[Any] = web.AppKey("nvml")  # mscale.probes.nvml_api.Nvml, real or simulated; None without one
PROBES: web.AppKey[list[tuple[Probe, float, float]]] = web.AppKey("probes")  # [(probe, interval_s, timeout_s)]
RUNNER: web.AppKey[ProbeRunner] = web.AppKey("runner")
REGISTRY: web.AppKey[CollectorRegistry] = web.AppKey("registry")
LINK: web.AppKey[LinkServer] = web.AppKey("link")
ENGINE: web.AppKey[HealingEngine] = web.AppKey("engine")

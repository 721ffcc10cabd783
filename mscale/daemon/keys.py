"""Typed aiohttp application keys shared by the agent's route and service modules."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from mscale.config import Config
from mscale.daemon.state import AgentState

CONFIG = web.AppKey("config", Config)
STATE = web.AppKey("state", AgentState)
CLOCK = web.AppKey("clock", Callable[[], float])
NVML = web.AppKey("nvml", Any)  # mscale.probes.nvml_api.Nvml, real or simulated; None without one
PROBES = web.AppKey("probes", list)  # [(probe, interval_s, timeout_s)]
RUNNER = web.AppKey("runner", Any)  # mscale.daemon.runner.ProbeRunner
REGISTRY = web.AppKey("registry", Any)  # prometheus_client CollectorRegistry
LINK = web.AppKey("link", Any)  # mscale.daemon.link.LinkServer
ENGINE = web.AppKey("engine", Any)  # mscale.healing.engine.HealingEngine

"""`mscale agent`: the node agent's entry point. The only place that decides to exit."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
import time
from typing import Any

import structlog

from mscale import config as configmod
from mscale import logs
from mscale.daemon import httpserver, keys
from mscale.daemon.app import create_app, new_state
from mscale.daemon.chaos import enabled as chaos_enabled
from mscale.daemon.notify import Notifier
from mscale.link import DEFAULT_HOST, DEFAULT_LISTEN, DEFAULT_SOCKET

HELP = "run the node agent (the daemon systemd starts)"
log = structlog.get_logger("mscale.agent")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help=f"TOML config (default {configmod.DEFAULT_PATH} if present)")
    p.add_argument("--simulate", metavar="TIMELINE.yaml", help="simulated GPUs driven by this fault timeline")
    p.add_argument("--listen", metavar="HOST:PORT", help=f"HTTP listen address (default {DEFAULT_LISTEN})")
    p.add_argument("--socket", metavar="PATH", help=f"Unix socket for the hook library (default {DEFAULT_SOCKET})")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise configmod.ConfigError(f"agent.listen: expected HOST:PORT, got {value!r}")
    return host.strip("[]") or DEFAULT_HOST, int(port)


def config_from_args(args: argparse.Namespace) -> configmod.Config:
    cfg = configmod.load(args.config)
    agent = cfg.agent
    overrides = {
        "simulate": args.simulate,
        "listen": args.listen,
        "socket_path": args.socket,
        "log_level": args.log_level,
    }
    agent = dataclasses.replace(agent, **{k: v for k, v in overrides.items() if v is not None})
    parse_listen(agent.listen)
    return cfg.replace(agent=agent)


def open_nvml(cfg: configmod.Config, clock) -> Any:
    """The GPU backend: simulated GPUs from a timeline, else the real NVML (None if absent;
    the GPU probe then reports itself down with the reason)."""
    if cfg.agent.simulate:
        from mscale.sim.nvml import SimNvml

        return SimNvml.from_timeline_file(cfg.agent.simulate, clock=clock)
    if cfg.probes.gpu.backend == "nvml":
        from mscale.probes.base import ProbeUnavailable
        from mscale.probes.nvml_api import open_real_nvml

        try:
            return open_real_nvml()
        except ProbeUnavailable as e:  # no driver here: serve anyway, the GPU probe says why
            log.warning("nvml_unavailable", reason=str(e))
    return None


async def serve(
    cfg: configmod.Config,
    nvml: Any,
    *,
    stop: asyncio.Event | None = None,
    notifier: Notifier | None = None,
    clock=time.time,
) -> None:
    stop = stop or asyncio.Event()
    notifier = notifier or Notifier()
    app = create_app(cfg, state=new_state(cfg), nvml=nvml, clock=clock)
    runner = httpserver.make_runner(app)  # idle timeout; the site adds the connection caps
    await runner.setup()
    host, port = parse_listen(cfg.agent.listen)
    site = httpserver.LimitedSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]  # the real port when 0 was asked
    url = f"http://{bound[0]}:{bound[1]}"
    log.info("agent_listening", metrics_url=f"{url}/metrics", api_url=f"{url}/api/v1", node=app[keys.STATE].node)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if chaos_enabled(cfg) and not cfg.chaos.token:
        log.warning("chaos_without_token", hint="set chaos.token or MSCALE_CHAOS_TOKEN; every chaos call is refused")
    notifier.ready(f"serving {url}")

    async def watchdog() -> None:
        while notifier.watchdog_interval_s:
            notifier.watchdog()
            await asyncio.sleep(notifier.watchdog_interval_s)

    dog = asyncio.create_task(watchdog())
    try:
        await stop.wait()
    finally:
        log.info("agent_stopping")
        notifier.stopping()
        dog.cancel()
        try:
            await asyncio.wait_for(runner.cleanup(), cfg.agent.shutdown_timeout_s)
        except TimeoutError:
            log.warning("agent_shutdown_timeout", timeout_s=cfg.agent.shutdown_timeout_s)
        notifier.close()
        log.info("agent_stopped")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except configmod.ConfigError as e:
        print(f"mscale agent: config error: {e}", file=sys.stderr)
        return 2
    logs.configure(cfg.agent.log_level)
    try:
        from mscale.probes.gpu_health import load_xid_table

        load_xid_table(cfg.health.xid_table or None)  # a data file, checked before anything starts
        from mscale.healing.policy import load as load_policy

        load_policy(cfg.healing.policy)  # so is the healing policy
        nvml = open_nvml(cfg, time.time)
    except ValueError as e:  # a malformed timeline (TimelineError) or Xid table names the line at fault
        print(f"mscale agent: {e}", file=sys.stderr)
        return 2
    asyncio.run(serve(cfg, nvml))
    return 0

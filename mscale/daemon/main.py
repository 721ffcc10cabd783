"""`mscale agent`: the node agent's entry point. The only place that decides to exit.

Exit codes: 0 after a stop (SIGTERM or SIGINT); 2 when it cannot start: a malformed config,
policy, Xid table or timeline (the message names file, line and key), a listen address it
cannot bind (named), an unusable hook socket path (named). A stop always ends the process
within `agent.shutdown_timeout_s`: the clean shutdown gets that long less a reserve, and a
timer armed by the signal ends the process at the deadline if anything (a hung hardware
call, a wedged event loop) still holds it, logging `agent_shutdown_forced`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import web

from mscale import logs
from mscale.daemon import config as configmod
from mscale.daemon import httpserver, keys
from mscale.daemon.app import create_app, new_state
from mscale.daemon.chaos import enabled as chaos_enabled
from mscale.daemon.notify import Notifier
from mscale.kube.remediation.ledger import StateFileRefused
from mscale.kube.remediation.ledger import check as check_state_file
from mscale.link import DEFAULT_HOST, DEFAULT_LISTEN, DEFAULT_SOCKET, printable

HELP = "run the node agent (the daemon systemd starts)"
log = structlog.get_logger("mscale.agent")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help=f"TOML config (default {configmod.DEFAULT_PATH} if present)")
    p.add_argument("--simulate", metavar="TIMELINE.yaml", help="simulated GPUs driven by this fault timeline")
    p.add_argument("--listen", metavar="HOST:PORT", help=f"HTTP listen address (default {DEFAULT_LISTEN})")
    p.add_argument("--socket", metavar="PATH", help=f"Unix socket for the hook library (default {DEFAULT_SOCKET})")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))


class StartupError(Exception):
    """The agent cannot start serving (a listen address or socket path it cannot use); exit 2."""


_PORT = re.compile(r"[0-9]{1,5}")
_HOSTNAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)
# sun_path is 108 bytes on Linux, the terminating NUL included.
MAX_SOCKET_PATH_BYTES = 107


def parse_listen(value: str, *, where: str = "agent.listen") -> tuple[str, int]:
    """HOST:PORT -> (host, port): the host an IP address (IPv6 in brackets) or a name that
    resolves, the port 0..65535 (0 picks one). Anything else raises ConfigError at `where`."""
    host, sep, port = value.rpartition(":")
    if not sep or not _PORT.fullmatch(port) or not 0 <= int(port) <= 65535:
        raise configmod.ConfigError(f"{where}: expected HOST:PORT with a port 0..65535, got {value[:100]!r}")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    if not host:
        return DEFAULT_HOST, int(port)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None:
        if bracketed != (ip.version == 6):
            raise configmod.ConfigError(f"{where}: an IPv6 address goes in brackets ([::1]:PORT), got {value!r}")
        return host, int(port)
    if re.fullmatch(r"[0-9.]+", host):  # a dotted quad out of range (256.1.1.1), not a name
        raise configmod.ConfigError(f"{where}: {host!r} is not a valid IPv4 address, in {value[:100]!r}")
    if bracketed or not _HOSTNAME.fullmatch(host):
        raise configmod.ConfigError(
            f"{where}: expected HOST:PORT, HOST an IP address or a host name, got {value[:100]!r}"
        )
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise configmod.ConfigError(f"{where}: host {host!r} does not resolve ({why}), in {value!r}") from None
    return host, int(port)


def check_socket_path(path: str, *, where: str = "agent.socket_path") -> None:
    """A path AF_UNIX can bind: not empty, no NUL byte, at most 107 bytes."""
    if not path:
        raise configmod.ConfigError(f"{where}: expected a path for the hook socket, got ''")
    if "\0" in path:
        raise configmod.ConfigError(f"{where}: the path contains a NUL byte: {path[:200]!r}")
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH_BYTES:
        raise configmod.ConfigError(
            f"{where}: {path[:200]!r} is {size} bytes, too long for a Unix socket (at most {MAX_SOCKET_PATH_BYTES})"
        )


def _origin(args: argparse.Namespace, flag: str, dotted: str) -> str:
    """Where a setting came from, for messages: the flag, the config file's line, or the default."""
    if getattr(args, flag.removeprefix("--"), None) is not None:
        return f"{dotted} ({flag})"
    path = args.config or (configmod.DEFAULT_PATH if configmod.DEFAULT_PATH.exists() else None)
    return configmod.locate(path, dotted) if path is not None else f"{dotted} (default)"


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
    parse_listen(agent.listen, where=_origin(args, "--listen", "agent.listen"))
    check_socket_path(agent.socket_path, where=_origin(args, "--socket", "agent.socket_path"))
    return cfg.replace(agent=agent)


def open_nvml(cfg: configmod.Config, clock: Callable[[], float]) -> Any:
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


def _flush_streams() -> None:
    """Flush what was logged before an os._exit, which skips the interpreter's own flush."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


class HardStop:
    """Armed by the first stop signal: ends the process at the deadline if the clean shutdown
    has not (a hung thread or a wedged loop cannot keep the agent alive past it)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.deadline: float | None = None  # time.monotonic() by which the process ends
        self._lock = threading.Lock()

    def arm(self) -> None:
        with self._lock:
            if self.deadline is not None:
                return
            self.deadline = time.monotonic() + self.timeout_s
        timer = threading.Timer(self.timeout_s, self._expire)
        timer.daemon = True
        timer.name = "mscale-hard-stop"
        timer.start()

    def _expire(self) -> None:
        log.error("agent_shutdown_forced", timeout_s=self.timeout_s)
        _flush_streams()
        os._exit(0)  # the stop was asked for and is done; what was abandoned is logged above

    def budget_s(self) -> float:
        """Time the clean shutdown may take: to the deadline, less a reserve for the
        interpreter to exit."""
        reserve = min(1.0, self.timeout_s / 4)
        if self.deadline is None:
            return self.timeout_s - reserve
        return max(0.0, self.deadline - time.monotonic() - reserve)


async def serve(
    cfg: configmod.Config,
    nvml: Any,
    *,
    stop: asyncio.Event | None = None,
    notifier: Notifier | None = None,
    clock: Callable[[], float] = time.time,
) -> None:
    stop = stop or asyncio.Event()
    notifier = notifier or Notifier()
    loop = asyncio.get_running_loop()
    hard_stop = HardStop(cfg.agent.shutdown_timeout_s)

    def on_signal(signum: int, frame: Any) -> None:
        # A Python-level handler, not loop.add_signal_handler: it runs even while the loop is
        # wedged, so the hard stop is armed whatever the loop is doing.
        hard_stop.arm()
        loop.call_soon_threadsafe(stop.set)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        await _serve(cfg, nvml, stop, notifier, clock, hard_stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def _start(cfg: configmod.Config, app: web.Application, runner: web.AppRunner) -> str:
    """Start the HTTP site and the hook socket; the URL served. StartupError names what failed."""
    await runner.setup()
    link = app.get(keys.LINK)
    if link is not None and link.error:  # "" while the socket is served
        raise StartupError(f"agent.socket_path: cannot serve the hook socket at {cfg.agent.socket_path}: {link.error}")
    host, port = parse_listen(cfg.agent.listen)
    site = httpserver.LimitedSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:
        raise StartupError(f"agent.listen: cannot listen on {cfg.agent.listen}: {e.strerror or e}") from None
    bound = runner.addresses[0]  # the real port when 0 was asked
    return f"http://{bound[0]}:{bound[1]}"


async def _serve(
    cfg: configmod.Config,
    nvml: Any,
    stop: asyncio.Event,
    notifier: Notifier,
    clock: Callable[[], float],
    hard_stop: HardStop,
) -> None:
    app = create_app(cfg, state=new_state(cfg), nvml=nvml, clock=clock)
    runner = httpserver.make_runner(app)  # idle timeout; the site adds the connection caps
    try:
        url = await _start(cfg, app, runner)
    except StartupError:
        try:
            async with asyncio.timeout(hard_stop.budget_s()):
                await runner.cleanup()
        except TimeoutError:
            log.warning("agent_shutdown_timeout", timeout_s=cfg.agent.shutdown_timeout_s)
        raise
    log.info("agent_listening", metrics_url=f"{url}/metrics", api_url=f"{url}/api/v1", node=app[keys.STATE].node)
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
            async with asyncio.timeout(hard_stop.budget_s()):
                await runner.cleanup()
        except TimeoutError:
            log.warning("agent_shutdown_timeout", timeout_s=cfg.agent.shutdown_timeout_s)
        notifier.close()
        log.info("agent_stopped")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except configmod.ConfigError as e:
        print(f"mscale agent: config error: {printable(e)}", file=sys.stderr)  # the file's text, escaped
        return 2
    logs.configure(cfg.agent.log_level)
    try:
        from mscale.probes.gpu_health import load_xid_table

        load_xid_table(cfg.health.xid_table or None)  # a data file, checked before anything starts
        from mscale.healing.policy import load as load_policy

        load_policy(cfg.healing.policy)  # so is the healing policy
        if cfg.remediation.enabled and cfg.remediation.state_file:
            check_state_file(cfg.remediation.state_file)  # a regular file or none: a FIFO would hang the start
        nvml = open_nvml(cfg, time.time)
    except ValueError as e:  # a malformed timeline (TimelineError) or Xid table names the line at fault
        print(f"mscale agent: {printable(e)}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(cfg, nvml))
        code = 0
    except (StartupError, StateFileRefused) as e:  # (the state file swapped since the check above)
        print(f"mscale agent: {printable(e)}", file=sys.stderr)
        code = 2
    _exit_now_if_samples_left(code)
    return code


def _exit_now_if_samples_left(code: int) -> None:
    """End the process without interpreter finalisation while a probe's sample thread is still
    in C code (a hung driver call, a BPF compile): finalising under it can crash the process
    and turn a clean exit code into a segfault."""
    from mscale.daemon.runner import probe_threads_left

    left = probe_threads_left()
    if not left:
        return
    log.warning("agent_exit_with_samples_running", threads=left)
    _flush_streams()
    os._exit(code)

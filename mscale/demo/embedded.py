"""The agent in a background thread of this process, on simulated GPUs.

The demo and the agent-path tests run the real agent (create_app: probes, link socket,
webhook, chaos API, healing engine) on its own asyncio loop in a daemon thread, serving on
127.0.0.1 (port 0 picks one) with its socket in a temporary directory, while the training
loop runs in the main thread and connects to it like any job. It is asked over HTTP with
`agent.client`, the `mscale.agent_client.AgentClient` that `mscale status` and `mscale chaos` use.
"""

from __future__ import annotations

import asyncio
import secrets
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from mscale.agent_client import AgentClient
from mscale.daemon import config as configmod
from mscale.link import DEFAULT_HOST

LOOPBACK_ANY_PORT = f"{DEFAULT_HOST}:0"


def agent_config(
    *,
    socket_path: str,
    listen: str = LOOPBACK_ANY_PORT,
    token: str = "",
    chaos_token: str = "",
    gpu_interval_s: float = 0.2,
    healing: dict | None = None,
    webhook: dict | None = None,
    http: dict | None = None,
    chaos: dict | None = None,
) -> configmod.Config:
    return configmod.from_dict(
        {
            "agent": {"listen": listen, "socket_path": socket_path, "node": "sim-node", "log_level": "warning"},
            "probes": {"gpu": {"interval_s": gpu_interval_s}, "host": {"enabled": False}, "ebpf": {"enabled": False}},
            "webhook": {"token": token or secrets.token_hex(16), **(webhook or {})},
            # simulated GPUs without a timeline file: chaos on explicitly, with its own token
            "chaos": {"enabled": True, "token": chaos_token or secrets.token_hex(16), **(chaos or {})},
            "http": http or {},
            "healing": healing or {},
        }
    )


class EmbeddedAgent:
    """`with EmbeddedAgent() as agent:` ... agent.url, agent.client, agent.socket_path, agent.app,
    agent.nvml; agent.token (the webhook's) and agent.chaos_token, generated."""

    def __init__(
        self,
        *,
        gpus: int = 8,
        listen: str = LOOPBACK_ANY_PORT,
        workdir: str | None = None,
        gpu_interval_s: float = 0.2,
        healing: dict | None = None,
        webhook: dict | None = None,
        http: dict | None = None,
        chaos: dict | None = None,
    ) -> None:
        from mscale.sim.nvml import SimNvml

        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if workdir:
            base = Path(workdir)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="mscale-agent-")
            base = Path(self._tmp.name)
        base.mkdir(parents=True, exist_ok=True)
        self.socket_path = str(base / "agent.sock")
        self.token = secrets.token_hex(16)
        self.chaos_token = secrets.token_hex(16)
        self.config = agent_config(
            socket_path=self.socket_path,
            listen=listen,
            token=self.token,
            chaos_token=self.chaos_token,
            http=http,
            chaos=chaos,
            gpu_interval_s=gpu_interval_s,
            healing=healing,
            webhook=webhook,
        )
        self.nvml = SimNvml(gpus)
        self.url = ""
        self.client: AgentClient | None = None  # once started
        self.app: web.Application | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self, timeout: float = 30.0) -> EmbeddedAgent:
        self._thread = threading.Thread(target=self._main, name="mscale-agent", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"the embedded agent did not start within {timeout:g} s")
        if self._error is not None:
            raise RuntimeError(f"the embedded agent failed to start: {self._error}") from self._error
        return self

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # reported to start(); the thread ends
            self._error = e
            self._ready.set()

    async def _serve(self) -> None:
        from mscale.daemon.app import create_app
        from mscale.daemon.httpserver import LimitedSite, make_runner
        from mscale.daemon.main import parse_listen

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.app = create_app(self.config, nvml=self.nvml)
        runner = make_runner(self.app)
        await runner.setup()
        host, port = parse_listen(self.config.agent.listen)
        site = LimitedSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0]  # the real port when 0 was asked
        self.url = f"http://{bound[0]}:{bound[1]}"
        self.client = AgentClient(self.url, chaos_token=self.chaos_token)
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def stop(self, timeout: float = 15.0) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> EmbeddedAgent:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # --- talking to it (as any client would, over HTTP) ------------------------------------

    def _client(self) -> AgentClient:
        if self.client is None:
            raise RuntimeError("the embedded agent is not started")
        return self.client

    def get(self, path: str, timeout: float = 10.0) -> Any:
        """GET path: parsed JSON under /api/, else the text (e.g. /metrics)."""
        client = self._client()
        return (
            client.get_json(path, timeout=timeout)
            if path.startswith("/api/")
            else client.get_text(path, timeout=timeout)
        )

    def post(self, path: str, body: dict, *, token: str | None = None, timeout: float = 10.0) -> tuple[int, Any]:
        return self._client().post_json(path, body, token=token, timeout=timeout)

    def chaos(self, body: dict, *, timeout: float = 10.0) -> tuple[int, Any]:
        """POST /api/v1/chaos with this agent's chaos token."""
        return self.post("/api/v1/chaos", body, token=self.chaos_token, timeout=timeout)

    def events(self, since: int = 0) -> list[dict]:
        return self._client().events(since)

    def wait_for(self, predicate, timeout: float = 30.0, interval: float = 0.05) -> Any:
        """Poll the agent's events until predicate(events) is truthy; its value, or TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate(self.events())
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"condition not met within {timeout:g} s")
            time.sleep(interval)

    def call(self, fn, *args: Any, timeout: float = 10.0) -> Any:
        """Run fn(app, *args) on the agent's loop (a coroutine function or a plain one)."""

        async def go() -> Any:
            r = fn(self.app, *args)
            return await r if asyncio.iscoroutine(r) else r

        if self._loop is None:
            raise RuntimeError("the embedded agent is not started")
        return asyncio.run_coroutine_threadsafe(go(), self._loop).result(timeout)

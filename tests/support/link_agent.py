"""A real agent app (API + hook link) served from its own thread and event loop, for tests that
drive the link from the test process; and a raw websocket client of its socket."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request

import aiohttp
from aiohttp import web

from mscale.daemon import keys
from mscale.daemon.app import create_app
from mscale.daemon.config import Config
from mscale.daemon.settings import AgentSection, SocketSection
from support import free_port

FEATURES = ("mscale.daemon.api", "mscale.daemon.link", "mscale.daemon.standby", "mscale.daemon.status_api")


def metric(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not in /metrics")


def wait_for(cond, timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class Agent:
    """A real agent app (API + link) served from its own thread and event loop."""

    def __init__(
        self,
        socket_path: str,
        agent_cfg: dict | None = None,
        *,
        features: tuple[str, ...] = FEATURES,
        sections: dict | None = None,
        **socket_cfg,
    ) -> None:
        """`features`: the agent's feature modules; `sections`: other config sections by name."""
        self.socket_path = socket_path
        self.port = free_port()
        self.features = features
        self.config = Config(
            agent=AgentSection(listen=f"127.0.0.1:{self.port}", socket_path=socket_path, **(agent_cfg or {})),
            socket=SocketSection(**socket_cfg),
            **(sections or {}),
        )
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(20), "agent did not start"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main():
            self.app = create_app(self.config, probes=[], features=self.features)
            self.runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
            self.stopping = asyncio.Event()
            self.ready.set()
            await self.stopping.wait()
            await self.runner.cleanup()

        self.loop.run_until_complete(main())

    @property
    def state(self):
        return self.app[keys.STATE]

    @property
    def link(self):
        return self.app[keys.LINK]

    def call(self, coro, timeout_s: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def metrics(self) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10).read().decode()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(20)


class RawLink:
    """One websocket connection to the agent's socket, driven from the calling thread: `ask`
    sends a frame and returns the agent's answer (a str, or the aiohttp message type when the
    connection closed)."""

    def __init__(self, socket_path: str, max_msg_size: int = 0) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.session: aiohttp.ClientSession | None = None
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self._call(self._open(socket_path, max_msg_size))

    def _call(self, coro, timeout_s: float = 15.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _open(self, path: str, max_msg_size: int) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path))
        self.ws = await self.session.ws_connect("http://localhost/v1/link", max_msg_size=max_msg_size)

    async def _ask(self, frame: str | bytes):
        assert self.ws is not None
        await (self.ws.send_bytes(frame) if isinstance(frame, bytes) else self.ws.send_str(frame))
        msg = await self.ws.receive(timeout=10)
        return msg.data if msg.type == aiohttp.WSMsgType.TEXT else msg.type

    def ask(self, frame: str | bytes):
        return self._call(self._ask(frame))

    def send(self, frame: str) -> None:
        """Send a frame that gets no answer when taken (a report)."""
        assert self.ws is not None
        self._call(self.ws.send_str(frame))

    @property
    def close_code(self) -> int | None:
        return self.ws.close_code if self.ws is not None else None

    async def _close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.session is not None:
            await self.session.close()

    def close(self) -> None:
        if not self.thread.is_alive():
            return  # closed already
        try:
            self._call(self._close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

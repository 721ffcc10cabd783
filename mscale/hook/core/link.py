"""The hook library's side of the link to the node agent.

A daemon thread runs its own asyncio loop with an aiohttp websocket over the agent's Unix
socket. The training thread only appends to a bounded queue (`report`, `send`): when the
queue is full the oldest report is dropped and counted, so the step never waits for the
agent. The thread registers (job id, rank, PID, MPUs with their devices and GPU bindings),
sends the queued reports in batches, hands commands to `on_command`, and reconnects by itself
with a capped backoff; while the agent is down, training and in-process detection go on.

Before it says anything the client checks who listens: the socket's peer credentials
(SO_PEERCRED, the listener's uid) must be one of `agent_uids` (root, the job's own uid, the
configured agent uid: mscale.link.agent_uids). Another uid (a user who swapped the socket) gets
no registration, no report and no say: the connection is closed, an `agent_untrusted` finding
goes to `findings` (once per such uid in a row; the guard emits them), and the job runs alone, trying again later.

What goes over the wire (messages, commands, limits) is `mscale.link`'s, which the agent's
server speaks too.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import struct
import threading
from collections.abc import Callable

import aiohttp
import structlog

from mscale import link as protocol
from mscale.findings import Finding, Reason, Severity
from mscale.link import Msg, Wire

log = structlog.get_logger("mscale.hook.core.link")


class UntrustedAgent(Exception):
    """The socket's listener is not a uid the job trusts as its agent."""


class LinkClient:
    def __init__(
        self,
        socket_path: str,
        *,
        registration: Callable[[], protocol.Register],
        on_command: Callable[[Wire], object],
        queue_max: int = 256,
        backoff_s: tuple[float, float] = (0.05, 2.0),
        connect_timeout_s: float = 2.0,
        agent_uids: frozenset[int] | None = None,
    ) -> None:
        if queue_max < 1:
            raise ValueError(f"queue_max: expected >= 1, got {queue_max}")
        self.socket_path = socket_path
        self.registration = registration
        self.on_command = on_command
        self.backoff_s = backoff_s
        self.connect_timeout_s = connect_timeout_s
        self.agent_uids = protocol.agent_uids() if agent_uids is None else frozenset(agent_uids)
        self.findings: collections.deque[Finding] = collections.deque(maxlen=64)  # the guard emits them
        self.untrusted_uid: int | None = None  # the uid last refused as the agent, until a trusted one
        self.queue: collections.deque[protocol.StepReport] = collections.deque()
        self.queue_max = queue_max
        self.dropped = 0  # reports dropped (queue full), reported to the agent
        self.sent = 0  # reports sent
        self.connects = 0  # successful (re)connections
        self.connected = False
        self.commands_received = 0
        self.last_error = ""
        self.node = ""  # the agent's node name, once registered
        self._messages: collections.deque[Wire] = collections.deque(maxlen=1024)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._reregister = False
        self._job_id = ""
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    # --- training thread ---------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mscale-link", daemon=True)
        self._thread.start()
        self._started.wait(5.0)

    def report(self, report: protocol.StepReport) -> None:
        """Queue one step's report; never blocks. Drops the oldest when full."""
        with self._lock:
            if len(self.queue) >= self.queue_max:
                self.queue.popleft()
                self.dropped += 1
            self.queue.append(report)
        self._poke()

    def send(self, message: Wire) -> None:
        """Queue any other message (reply, pong, plugin message); oldest dropped past 1024."""
        self._messages.append(message)
        self._poke()

    def update_registration(self) -> None:
        """Send the registration again (an MPU was rebound)."""
        self._reregister = True
        self._poke()

    def stop(self, timeout_s: float = 2.0) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:
                pass
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # loop closed: the link is stopping
                pass

    # --- link thread -------------------------------------------------------------------

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        finally:
            loop.close()

    async def _main(self) -> None:
        self._wake, self._stop = asyncio.Event(), asyncio.Event()
        self._started.set()
        delay = self.backoff_s[0]
        while not self._stop.is_set():
            try:
                await self._session()
                delay = self.backoff_s[0]
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError, UntrustedAgent) as e:
                self.last_error = f"{type(e).__name__}: {e}"
            except Exception as e:  # never let the link thread die
                self.last_error = f"{type(e).__name__}: {e}"
                log.exception("link_error", error=self.last_error)
            if self.connected:
                self.connected = False
                log.warning("agent_disconnected", socket=self.socket_path, error=self.last_error)
            try:
                async with asyncio.timeout(delay):  # not wait_for: on 3.11 it can drop a cancel
                    await self._stop.wait()
            except TimeoutError:
                pass
            delay = min(delay * 2, self.backoff_s[1])

    async def _session(self) -> None:
        connector = aiohttp.UnixConnector(path=self.socket_path)
        timeout = aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            async with session.ws_connect(f"http://localhost{protocol.PATH}", heartbeat=10.0) as ws:
                self._check_peer(ws)
                reg = self.registration()
                self._job_id = reg.job_id
                await ws.send_str(protocol.encode(reg.to_wire()))
                self._reregister = False
                self.connected = True
                self.connects += 1
                log.info("agent_connected", socket=self.socket_path, connects=self.connects)
                receiver = asyncio.ensure_future(self._receive(ws))
                try:
                    await self._send_loop(ws, receiver)
                finally:
                    receiver.cancel()
                    await asyncio.gather(receiver, return_exceptions=True)

    def _check_peer(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """Refuse (UntrustedAgent) a listener whose uid is not one of agent_uids."""
        sock = ws.get_extra_info("socket")
        uid = -1
        if sock is not None and sock.family == socket.AF_UNIX:
            raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _pid, uid, _gid = struct.unpack("3i", raw)
        if uid in self.agent_uids:
            self.untrusted_uid = None
            return
        if uid != self.untrusted_uid:
            self.untrusted_uid = uid
            trusted = ", ".join(str(u) for u in sorted(self.agent_uids))
            message = (
                f"the socket {self.socket_path} is served by uid {uid}, not the agent (uids {trusted}): "
                "nothing sent to it, the job runs without the agent (set MSCALE_AGENT_UID if the agent runs as it)"
            )
            log.error("agent_untrusted", socket=self.socket_path, peer_uid=uid)
            self.findings.append(
                Finding("link", Reason.AGENT_UNTRUSTED, Severity.CRITICAL, message, {"peer_uid": str(uid)})
            )
        raise UntrustedAgent(f"socket served by uid {uid}, not a trusted agent uid")

    async def _send_loop(self, ws: aiohttp.ClientWebSocketResponse, receiver: asyncio.Future[None]) -> None:
        assert self._wake is not None and self._stop is not None
        while not self._stop.is_set() and not receiver.done() and not ws.closed:
            self._wake.clear()
            if self._reregister:
                self._reregister = False
                await ws.send_str(protocol.encode(self.registration().to_wire()))
            while self._messages:
                await ws.send_str(protocol.encode(self._messages.popleft()))
            while True:
                with self._lock:
                    batch = [self.queue.popleft() for _ in range(min(protocol.MAX_BATCH, len(self.queue)))]
                    dropped = self.dropped
                if not batch:
                    break
                await ws.send_str(protocol.encode(protocol.Report(self._job_id, dropped, tuple(batch)).to_wire()))
                self.sent += len(batch)
            waits = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(self._stop.wait())]
            await asyncio.wait(waits + [receiver], return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
        if self._stop.is_set():
            await ws.close()

    async def _receive(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        async for msg in ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            try:
                command = protocol.decode(msg.data)
            except protocol.BadMessage as e:
                log.warning("agent_message_not_understood", error=str(e))
                continue
            if command["type"] == Msg.ERROR:
                log.warning("agent_refused_message", error=command.get("error"))
                continue
            if command["type"] == Msg.REGISTERED:
                self.node = str(command.get("node", ""))
                continue
            self.commands_received += 1
            self.on_command(command)

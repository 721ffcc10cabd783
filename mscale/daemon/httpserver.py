"""The agent's HTTP listener, with connection limits: no HTTP client can make the agent run
out of file descriptors or keep /healthz and /metrics from answering.

    runner = make_runner(app)          # web.AppRunner with http.idle_timeout_s as keep-alive
    await runner.setup()
    await LimitedSite(runner, host, port).start()

Every accepted connection passes a gate (`_Gate`, a protocol in front of aiohttp's own):

- at most `http.max_connections_per_peer` open from one peer address and
  `http.max_connections` in all, the latter kept below the process's open-files limit (less a
  reserve for probes, the hook socket and logs). A connection over a cap first evicts the
  longest-idle connection that is not serving a request (of the same peer for the per-peer
  cap, of the busiest peer for the total), so a flood of idle connections cannot keep anyone
  out. A connection whose reader has stalled (its writes paused: the peer reads nothing of what
  was sent) counts as idle here and goes first, the longest-stalled (why="stalled_evicted"), so
  slow readers cannot keep a scrape out either. With none idle or stalled, the new one waits
  up to ADMIT_WAIT_S (unread, at most MAX_WAITING connections at a time) for room, as when a
  burst of requests waits for one render of /metrics and then stalls, and is closed past it
  (why="peer_limit" / "connection_limit"); past MAX_WAITING it is closed at once.
- its first request head must arrive within `http.header_timeout_s` (why="header_timeout");
  between requests aiohttp closes a connection idle for `http.idle_timeout_s`.
- a response its peer stops reading is closed after `http.write_timeout_s` of stalled writes
  (why="write_timeout"): a slow reader holds its descriptor and one chunk of the page
  (mscale.daemon.scrape writes /metrics in chunks) for that long at most. A stalled connection
  is closed with a reset, so the kernel drops what it still held for the reader, and the
  reader learns at once.

Refused and evicted connections are counted in `mscale_refused_messages_total{where="http"}`;
the log lines about them are rate-limited.
"""

from __future__ import annotations

import asyncio
import resource
import socket
import struct
from collections import defaultdict
from typing import Any

import structlog
from aiohttp import web

from mscale.daemon import keys
from mscale.daemon.access import RateLimitedLog
from mscale.daemon.gate import Gate

log = structlog.get_logger("mscale.http")
WHERE = "http"
FD_RESERVE = 128  # descriptors kept for everything that is not an HTTP client
ADMIT_WAIT_S = 1.0  # a connection over a cap waits this long for room (a render's length, with margin)
ADMIT_RETRY_S = 0.02  # how often it looks
MAX_WAITING = 64  # connections waiting for room at most (each holds a descriptor)


def make_runner(app: web.Application) -> web.AppRunner:
    """The app's runner, with `http.idle_timeout_s` as aiohttp's keep-alive timeout."""
    return web.AppRunner(
        app, handle_signals=False, access_log=None, keepalive_timeout=app[keys.CONFIG].http.idle_timeout_s
    )


def fd_limited(max_connections: int) -> int:
    """`max_connections`, lowered to fit the soft open-files limit less FD_RESERVE."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(8, min(max_connections, soft - FD_RESERVE))


class Limiter:
    """Open connections by peer address; admits, evicts and refuses (see the module doc)."""

    def __init__(self, app: web.Application) -> None:
        cfg = app[keys.CONFIG].http
        self.state = app[keys.STATE]
        self.max_total = fd_limited(cfg.max_connections)
        self.max_per_peer = min(cfg.max_connections_per_peer, self.max_total)
        self.header_timeout_s = cfg.header_timeout_s
        self.write_timeout_s = cfg.write_timeout_s
        self.by_peer: dict[str, dict[_Gate, None]] = defaultdict(dict)  # insertion-ordered sets
        self.total = 0
        self.waiting = 0
        self.logger = RateLimitedLog()
        if self.max_total < cfg.max_connections:
            log.warning(
                "http_connections_capped_by_nofile",
                max_connections=cfg.max_connections,
                effective=self.max_total,
                hint="raise LimitNOFILE (ulimit -n)",
            )

    def count(self, why: str, **fields: Any) -> None:
        self.state.refused[(WHERE, why)] += 1
        self.logger.warning((WHERE, why), "http_connection_refused", why=why, **fields)

    def admit(self, gate: _Gate) -> str:
        """Admit the connection (evicting one if need be): "", or the cap that keeps it out."""
        peer = gate.peer
        if len(self.by_peer.get(peer, ())) >= self.max_per_peer:
            victim = self._idlest(self.by_peer[peer])
            if victim is None:
                return "peer_limit"
            self.evict(victim)
        if self.total >= self.max_total:
            busiest = max(self.by_peer.values(), key=len)
            victim = self._idlest(busiest) or self._idlest(g for gs in self.by_peer.values() for g in gs)
            if victim is None:
                return "connection_limit"
            self.evict(victim)
        self.by_peer[peer][gate] = None
        self.total += 1
        return ""

    def refuse(self, gate: _Gate, why: str) -> None:
        limit = self.max_per_peer if why == "peer_limit" else self.max_total
        self.count(why, peer=gate.peer, limit=limit)

    @staticmethod
    def _idlest(gates: Any) -> _Gate | None:
        """The longest-stalled connection, else the longest-idle one, else None."""
        stalled = [g for g in gates if g.stalled_at is not None]
        if stalled:
            return min(stalled, key=lambda g: g.stalled_at)
        idle = [g for g in gates if g.idle()]
        return min(idle, key=lambda g: g.last_rx) if idle else None

    def evict(self, gate: _Gate) -> None:
        self.count("stalled_evicted" if gate.stalled_at is not None else "idle_evicted", peer=gate.peer)
        self.release(gate)
        gate.close()

    def release(self, gate: _Gate) -> None:
        conns = self.by_peer.get(gate.peer)
        if conns is None or gate not in conns:
            return
        del conns[gate]
        self.total -= 1
        if not conns:
            del self.by_peer[gate.peer]


class _Gate(Gate):
    """In front of one aiohttp RequestHandler: admission, the first-head deadline, bookkeeping."""

    def __init__(self, limiter: Limiter, make: Any) -> None:
        super().__init__(make)
        self.limiter = limiter
        self.peer = ""
        self.head_seen = False
        self.last_rx = 0.0
        self.stalled_at: float | None = None  # loop time its writes were paused (its reader stalled)
        self._write_timer: asyncio.TimerHandle | None = None
        self.wait_until = 0.0  # over a cap: loop time it may wait for room until
        self._retry: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
        loop = asyncio.get_running_loop()
        self.last_rx = loop.time()
        self._timer = loop.call_later(self.limiter.header_timeout_s, self._header_deadline)
        why = self.limiter.admit(self)
        if not why:
            self._start()
        elif self.limiter.waiting >= MAX_WAITING:
            self._refuse(why)
        else:  # wait, unread, for room
            self.limiter.waiting += 1
            self.wait_until = self.last_rx + ADMIT_WAIT_S
            transport.pause_reading()
            self._retry = loop.call_later(ADMIT_RETRY_S, self._try_again)

    def _start(self) -> None:
        assert self.transport is not None
        self.inner = self.make()
        self.inner.connection_made(self.transport)

    def _refuse(self, why: str) -> None:
        self._stop_timer()
        self.limiter.refuse(self, why)
        if self.transport is not None:
            self.transport.abort()  # the descriptor is released now, not after a handshake

    def _stop_waiting(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
            self.limiter.waiting -= 1

    def _try_again(self) -> None:
        self._retry = None
        self.limiter.waiting -= 1
        if self.transport is None:
            return
        loop = asyncio.get_running_loop()
        why = self.limiter.admit(self)
        if not why:
            self.transport.resume_reading()
            self._start()
        elif loop.time() >= self.wait_until:
            self._refuse(why)
        else:
            self.limiter.waiting += 1
            self._retry = loop.call_later(ADMIT_RETRY_S, self._try_again)

    def _header_deadline(self) -> None:
        self._timer = None
        if not self.head_seen and self.transport is not None:
            self.limiter.count("header_timeout", peer=self.peer)
            self.limiter.release(self)
            self.close()

    def idle(self) -> bool:
        """Not serving a request: no complete request head yet, or aiohttp waiting for the next
        one (its own test for an idle keep-alive connection: a pending `_waiter`)."""
        if self.inner is None:
            return False
        if not self.head_seen:
            return True
        waiter = getattr(self.inner, "_waiter", None)
        return waiter is not None and not waiter.done()

    def close(self) -> None:
        if self.transport is None:
            return
        if self.stalled_at is not None:  # a reset: the kernel drops the unread data, the reader knows
            sock = self.transport.get_extra_info("socket")
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except (OSError, AttributeError):
                pass
        self.transport.abort()

    def pause_writing(self) -> None:
        # the peer's buffers are full: it reads nothing of what was sent; it has until the deadline
        loop = asyncio.get_running_loop()
        self.stalled_at = loop.time()
        if self._write_timer is None:
            self._write_timer = loop.call_later(self.limiter.write_timeout_s, self._write_deadline)
        super().pause_writing()

    def resume_writing(self) -> None:
        self._stop_write_timer()
        super().resume_writing()

    def _stop_write_timer(self) -> None:
        self.stalled_at = None
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_deadline(self) -> None:
        self._write_timer = None
        if self.transport is not None:
            self.limiter.count("write_timeout", peer=self.peer)
            self.limiter.release(self)
            self.close()

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        self.last_rx = asyncio.get_running_loop().time()
        if not self.head_seen and self._head_ends_in(data):
            self.head_seen = True
            self._stop_timer()
        self.inner.data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        self._stop_write_timer()
        self._stop_waiting()
        self.limiter.release(self)
        inner, self.inner, self.transport = self.inner, None, None
        if inner is not None:
            inner.connection_lost(exc)


class LimitedSite(web.TCPSite):
    """web.TCPSite whose connections pass the gate; limits from the app's [http] config."""

    __slots__ = ("limiter",)

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner
        runner = self._runner
        assert isinstance(runner, web.AppRunner) and runner.server is not None
        server = runner.server
        self.limiter = Limiter(runner.app)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Gate(self.limiter, server),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        if self._server.sockets:
            self._bound_port = self._server.sockets[0].getsockname()[1]

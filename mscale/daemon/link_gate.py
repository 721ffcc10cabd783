"""The hook socket's gate: what a connection may hold before it has said anything.

Every accepted connection on the hook socket passes `LinkGate` (a protocol in front of
aiohttp's own) before aiohttp reads a byte of it:

- its peer's uid (SO_PEERCRED) must be allowed (root, the agent's, `socket.allowed_uids`);
  another uid's connection is closed at once (why="peer_uid"), so a refused user's idle
  connections hold no descriptor;
- at most `socket.max_connections_per_uid` open from one uid (why="uid_connection_limit") and
  `socket.max_connections` in all (why="connection_limit", lowered at start to the open-files
  limit less a reserve), closed at once past either: one uid cannot fill the agent's
  descriptors and keep other users' jobs out;
- its websocket handshake (the HTTP upgrade head) must arrive within
  `socket.handshake_timeout_s` (why="handshake_timeout"): half a request head is closed too.

After the handshake the link server closes a connection that has not registered within
`socket.register_timeout_s` (mscale.daemon.link: a frame begun and never finished included).
Each refusal is counted in `mscale_refused_messages_total{where="socket"}`; log lines about them
are rate-limited.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections import defaultdict
from typing import Any

from aiohttp import web

from mscale.daemon.access import RateLimitedLog
from mscale.daemon.gate import Gate
from mscale.daemon.httpserver import fd_limited

WHERE = "socket"


def peer_cred(sock: socket.socket | None) -> tuple[int, int] | None:
    """(pid, uid) of a Unix socket's peer from SO_PEERCRED; None if it is not one."""
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", raw)
    return pid, uid


class LinkLimits:
    """Open hook-socket connections by uid; admits or refuses (see the module doc)."""

    def __init__(self, config: Any, state: Any, allowed_uids: set[int]) -> None:
        cfg = config.socket
        self.state, self.allowed_uids = state, allowed_uids
        self.max_total = fd_limited(cfg.max_connections)
        self.max_per_uid = min(cfg.max_connections_per_uid, self.max_total)
        self.handshake_timeout_s = cfg.handshake_timeout_s
        self.by_uid: dict[int, int] = defaultdict(int)
        self.total = 0
        self.logger = RateLimitedLog()

    def count(self, why: str, **fields: Any) -> None:
        self.state.refused[(WHERE, why)] += 1
        self.logger.warning((WHERE, why), "link_connection_refused", why=why, **fields)

    def admit(self, cred: tuple[int, int] | None) -> bool:
        if cred is None or cred[1] not in self.allowed_uids:
            self.count("peer_uid", uid=cred[1] if cred else -1, pid=cred[0] if cred else 0)
            return False
        uid = cred[1]
        if self.by_uid[uid] >= self.max_per_uid:
            self.count("uid_connection_limit", uid=uid, limit=self.max_per_uid)
            return False
        if self.total >= self.max_total:
            self.count("connection_limit", uid=uid, limit=self.max_total)
            return False
        self.by_uid[uid] += 1
        self.total += 1
        return True

    def release(self, uid: int) -> None:
        self.by_uid[uid] -= 1
        self.total -= 1
        if self.by_uid[uid] <= 0:
            del self.by_uid[uid]


class LinkGate(Gate):
    """In front of one aiohttp RequestHandler on the hook socket."""

    def __init__(self, limits: LinkLimits, make: Any) -> None:
        super().__init__(make)
        self.limits = limits
        self.uid = -1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        try:
            cred = peer_cred(transport.get_extra_info("socket"))
        except OSError:
            cred = None
        if not self.limits.admit(cred):
            transport.abort()  # at once: the descriptor is released now
            return
        assert cred is not None
        self.uid = cred[1]
        self._timer = asyncio.get_running_loop().call_later(self.limits.handshake_timeout_s, self._deadline)
        self.inner = self.make()
        self.inner.connection_made(transport)

    def _deadline(self) -> None:
        self._timer = None
        if self.transport is not None:
            self.limits.count("handshake_timeout", uid=self.uid)
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if self._timer is not None and self._head_ends_in(data):
            self._stop_timer()
        self.inner.data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        inner, self.inner, self.transport = self.inner, None, None
        if inner is not None:
            self.limits.release(self.uid)
            inner.connection_lost(exc)


class GatedSockSite(web.SockSite):
    """web.SockSite whose connections pass the LinkGate."""

    __slots__ = ("limits",)

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, limits: LinkLimits) -> None:
        super().__init__(runner, sock)
        self.limits = limits

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: LinkGate(self.limits, server), sock=self._sock)

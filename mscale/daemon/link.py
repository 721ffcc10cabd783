"""The agent's side of the link: a websocket on a Unix socket for the training processes.

`setup(app)` stores a `LinkServer` in `app[keys.LINK]` and runs it with the app: its own
small aiohttp app on `config.agent.socket_path` (file mode `socket.mode`), separate from the
HTTP API. Each connection's peer is checked with SO_PEERCRED: root, the agent's own user and
`socket.allowed_uids` only. A job registers, then sends batched per-step reports; they update
`state.jobs[job_id]` (mscale.daemon.jobs) and the findings in them go to the event log with
the job's labels, so the healing engine sees in-process detections too. Commands go the other
way (`send`, `broadcast`). A malformed, unknown or oversized message is refused, counted in
`state.refused[("socket", why)]` and answered with an error frame; other jobs never notice.
The messages, their validators, the command vocabulary and the limits are `mscale.link`'s,
which the job's client speaks too; this module only serves them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import stat
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
from aiohttp import WSMsgType, web

from mscale import link as protocol
from mscale.daemon import keys
from mscale.daemon.jobs import JobState, gpus_by_index
from mscale.findings import Finding, Reason, Severity
from mscale.link import BadMessage, Msg

log = structlog.get_logger("mscale.link")

Handler = Callable[[JobState, dict], Awaitable[None] | None]


def peer_uid(request: web.Request) -> tuple[int, int] | None:
    """(pid, uid) of the peer from SO_PEERCRED; None if the transport has no Unix socket."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


class LinkServer:
    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.config = app[keys.CONFIG]
        self.state = app[keys.STATE]
        self.path = self.config.agent.socket_path
        self.allowed_uids = {0, os.getuid(), *self.config.socket.allowed_uids}
        self.connections: dict[str, web.WebSocketResponse] = {}
        self.handlers: dict[str, Handler] = {}
        self.error = ""  # why the socket is not served, if it is not
        self._runner: web.AppRunner | None = None

    # --- commands to jobs ----------------------------------------------------------------

    async def send(self, job_id: str, command: dict) -> bool:
        """Send a command (a dict with "type", see mscale.link.Command) to a connected job;
        False if it is not there."""
        protocol.check_command(command)
        ws = self.connections.get(job_id)
        if ws is None or ws.closed:
            return False
        try:
            await ws.send_str(protocol.encode(command))
            return True
        except (ConnectionError, RuntimeError) as e:
            log.warning("command_not_sent", job_id=job_id, error=str(e))
            return False

    async def broadcast(self, command: dict) -> int:
        sent = await asyncio.gather(*(self.send(j, command) for j in list(self.connections)))
        return sum(sent)

    def on_message(self, type_: str, handler: Handler) -> None:
        """Handle another message type from jobs (e.g. a plugin's); handler(job, msg)."""
        if type_ in protocol.RESERVED:
            raise ValueError(f"{type_!r} is the link's own message type")
        self.handlers[type_] = handler

    # --- serving ---------------------------------------------------------------------------

    async def start(self) -> bool:
        path = Path(self.path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists() or path.is_symlink():
                if not stat.S_ISSOCK(path.lstat().st_mode):
                    raise OSError(f"{path} exists and is not a socket")
                if await _in_use(str(path)):
                    raise OSError(f"{path} is in use by another agent")
                path.unlink()  # stale, from an agent that died
            link_app = web.Application()
            link_app.router.add_get(protocol.PATH, self._handle)
            self._runner = web.AppRunner(link_app, access_log=None, handle_signals=False)
            await self._runner.setup()
            await web.UnixSite(self._runner, str(path)).start()
            os.chmod(path, self.config.socket.mode)
        except OSError as e:
            self.error = str(e)
            log.error("link_socket_unavailable", socket=str(path), error=self.error)
            if self._runner is not None:
                await self._runner.cleanup()
                self._runner = None
            return False
        log.info("link_listening", socket=str(path), mode=oct(self.config.socket.mode))
        return True

    async def stop(self) -> None:
        for ws in list(self.connections.values()):
            await ws.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def _refuse(self, why: str, detail: str, **labels: Any) -> None:
        self.state.refused[("socket", why)] += 1
        log.warning("link_message_refused", why=why, detail=detail, **labels)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        cred = peer_uid(request)
        if cred is None or cred[1] not in self.allowed_uids:
            self._refuse(
                "peer_uid", f"peer uid {cred[1] if cred else '?'} not allowed", peer_pid=cred[0] if cred else 0
            )
            return web.Response(status=403, text="uid not allowed on the mscale socket\n")
        ws = web.WebSocketResponse(max_msg_size=self.config.socket.max_message_bytes, heartbeat=30.0)
        await ws.prepare(request)
        job: JobState | None = None
        try:
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    try:
                        job = await self._message(ws, job, msg.data, cred[0])
                    except BadMessage as e:
                        self._refuse(e.why, str(e), job_id=job.job_id if job else "")
                        await ws.send_str(protocol.encode(protocol.error(str(e))))
                elif msg.type == WSMsgType.BINARY:
                    self._refuse("malformed", "binary frame")
                    await ws.send_str(protocol.encode(protocol.error("binary frames are not accepted")))
                elif msg.type == WSMsgType.ERROR:
                    exc = ws.exception()
                    why = (
                        "oversized" if "too big" in str(exc).lower() or getattr(exc, "code", 0) == 1009 else "malformed"
                    )
                    self._refuse(why, str(exc), job_id=job.job_id if job else "")
                    break
        finally:
            if job is not None and self.connections.get(job.job_id) is ws:
                del self.connections[job.job_id]
                job.connected = False
                self.state.events.emit(
                    Finding(
                        "link",
                        Reason.JOB_GONE,
                        Severity.WARNING,
                        f"job {job.job_id} disconnected",
                        {"job_id": job.job_id},
                    )
                )
        return ws

    async def _message(
        self, ws: web.WebSocketResponse, job: JobState | None, data: str, peer_pid: int
    ) -> JobState | None:
        msg = protocol.decode(data, self.config.socket.max_message_bytes)
        kind = msg["type"]
        if kind == Msg.REGISTER:
            protocol.validate_register(msg)
            job = self._register(ws, msg, peer_pid)
            await ws.send_str(protocol.encode(protocol.registered(job.job_id, self.state.node)))
            return job
        if job is None:
            raise BadMessage("unregistered", f"{kind}: register first")
        if kind == Msg.REPORT:
            if msg.get("job_id") != job.job_id:
                raise BadMessage("malformed", f"report: job_id {msg.get('job_id')!r} is not this connection's job")
            protocol.validate_report(msg)
            self._report(job, msg)
        elif kind in self.handlers:
            result = self.handlers[kind](job, msg)
            if asyncio.iscoroutine(result):
                await result
        elif kind not in protocol.ACCEPTED_SILENTLY:
            raise BadMessage("unknown_type", f"unknown message type {kind!r}")
        return job

    def _register(self, ws: web.WebSocketResponse, msg: dict, peer_pid: int) -> JobState:
        job_id = msg["job_id"]
        # the peer's PID as this kernel namespace sees it (the eBPF probe traces it)
        msg = {**msg, "pid": peer_pid or msg["pid"]}
        job = self.state.jobs.get(job_id)
        if job is None:
            job = JobState(job_id=job_id, rank=msg["rank"], pid=msg["pid"])
            self.state.jobs[job_id] = job
        elif self.connections.get(job_id) is not ws:
            job.connects += 1
        old = self.connections.get(job_id)
        if old is not None and old is not ws and not old.closed:
            asyncio.ensure_future(old.close())  # the job reconnected; the old link is dead to us
        job.register(msg)
        job.connected = True
        job.refresh(gpus_by_index(self.state))
        first = self.connections.get(job_id) is not ws
        self.connections[job_id] = ws
        if first:
            self.state.events.emit(
                Finding(
                    "link",
                    Reason.JOB_REGISTERED,
                    Severity.INFO,
                    f"job {job_id} rank {job.rank} pid {job.pid}: "
                    + ", ".join(f"{m.mpu_id}={m.name}@gpu{m.gpu}" for m in job.mpus.values()),
                    {"job_id": job_id, "rank": str(job.rank), "pid": str(job.pid)},
                )
            )
        return job

    def _report(self, job: JobState, msg: dict) -> None:
        gpus = gpus_by_index(self.state)
        job.reports_dropped = max(job.reports_dropped, msg.get("dropped", 0))
        for r in msg["reports"]:
            job.apply_report(r, gpus)
            for f in r.get("findings", []):
                finding = self._finding(job, f)
                if finding is None:
                    self._refuse("bad_finding", f"finding not understood: {str(f)[:200]}", job_id=job.job_id)
                else:
                    job.observe_finding(finding)
                    self.state.events.emit(finding)

    def _finding(self, job: JobState, f: Any) -> Finding | None:
        """A reported finding with the job's labels: its job_id, and the GPU of its MPU."""
        finding = protocol.finding(f)
        if finding is None:
            return None
        labels = dict(finding.labels)
        labels["job_id"] = job.job_id
        m = job.mpus.get(labels.get("mpu_id", ""))
        if m is not None:
            labels.setdefault("gpu", str(m.gpu))
            if m.gpu_uuid:
                labels.setdefault("gpu_uuid", m.gpu_uuid)
        return dataclasses.replace(finding, labels=labels)


async def _in_use(path: str) -> bool:
    try:
        _r, w = await asyncio.wait_for(asyncio.open_unix_connection(path), 1.0)
    except (TimeoutError, OSError):
        return False
    w.close()
    return True


def setup(app: web.Application) -> None:
    app[keys.LINK] = LinkServer(app)
    app.cleanup_ctx.append(_serve)


async def _serve(app: web.Application) -> AsyncIterator[None]:
    server = app[keys.LINK]
    await server.start()
    yield
    await server.stop()

"""The agent's side of the link: a websocket on a Unix socket for the training processes.

`setup(app)` stores a `LinkServer` in `app[keys.LINK]` and runs it with the app: its own
small aiohttp app on `config.agent.socket_path` (file mode `socket.mode`), separate from the
HTTP API. Each connection's peer is checked with SO_PEERCRED: root, the agent's own user and
`socket.allowed_uids` only. A job registers, then sends batched per-step reports; they update
`state.jobs[job_id]` (mscale.daemon.jobs) and the findings in them go to the event log with
the job's labels, so the healing engine sees in-process detections too. Commands go the other
way (`send`, `broadcast`). A malformed, unknown or oversized message is refused, counted in
`state.refused[("socket", why)]` and answered with an error frame, changing nothing; the
connection and other jobs go on. (A frame over twice `socket.max_message_bytes` cannot be read
at all: the connection is closed with code 1009, message too big, and counted as oversized.)

Identity and bounds: the first valid registration of a job id binds it to the peer's uid
(SO_PEERCRED) until the job expires; another uid's registration of it is refused (job_owner).
A (job, rank) has one live connection: a second one from another process is refused
(duplicate), the same process reconnecting replaces its dead link; a command goes only to
connections of the job owner's uid. Caps: `socket.max_jobs_per_uid` and `socket.max_jobs` (a
new job past either first pushes out its own uid's longest-disconnected job, never another
uid's, else uid_job_limit / job_limit),
`socket.max_ranks_per_job` (rank_limit: live ranks, and the ranks whose state the job keeps,
where a rank gone longest makes room for a new one), `socket.max_mpus_per_job` (mpu_limit).
State is per (job, rank) (mscale.daemon.jobs.RankState); a finding carries the rank of the
connection that reported it, and the agent's own view of its GPU (mscale.daemon.link_labels:
a proof about an MPU the rank never registered is refused, unregistered_mpu; past
MAX_PROOFS_PER_MESSAGE in one message, proof_limit). A job whose last rank left is removed, series and all,
`socket.job_expiry_s` later. Frames are handled one per event-loop turn, report work shed when
behind (mscale.daemon.link_intake). The messages, their validators, the command vocabulary and the limits are `mscale.link`'s,
which the job's client speaks too; this module only serves them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import structlog
from aiohttp import WSMsgType, web

from mscale import link as protocol
from mscale.daemon import keys, socket_file
from mscale.daemon.gpus import gpus_by_index
from mscale.daemon.jobs import JobState, RankLimit
from mscale.daemon.link_bounds import check_mpu_budget, make_room
from mscale.daemon.link_gate import GatedSockSite, LinkLimits, peer_cred
from mscale.daemon.link_intake import Inbox, Intake, read_frame
from mscale.daemon.link_labels import MAX_PROOFS_PER_MESSAGE, PROOFS, labelled
from mscale.findings import Finding, Reason, Severity
from mscale.link import BadMessage, Error, Msg, Register, Registered, Report, StepReport, Wire

log = structlog.get_logger("mscale.link")

ANSWER_TIMEOUT_S = 1.0
Handler = Callable[..., Awaitable[None] | None]  # (job, msg), or (job, msg, rank) with_rank
ReportObserver = Callable[[JobState, int, StepReport], None]


def peer_uid(request: web.Request) -> tuple[int, int] | None:
    """(pid, uid) of the peer from SO_PEERCRED; None if the transport has no Unix socket."""
    return peer_cred(request.transport.get_extra_info("socket") if request.transport else None)


class LinkServer:
    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.config = app[keys.CONFIG]
        self.state = app[keys.STATE]
        self.path = self.config.agent.socket_path
        self.allowed_uids = {0, os.getuid(), *self.config.socket.allowed_uids}
        # job id -> rank -> that rank's live connection
        self.connections: dict[str, dict[int, web.WebSocketResponse]] = {}
        self.peer_uids: dict[web.WebSocketResponse, int] = {}  # each live connection's SO_PEERCRED uid
        self.handlers: dict[str, Handler] = {}
        self.report_observers: list[ReportObserver] = []
        self._with_rank: dict[str, bool] = {}
        self.error = ""  # why the socket is not served, if it is not
        self._runner: web.AppRunner | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.intake = Intake(self._frame, self._shed)  # every connection's frames, one per loop turn (link_intake)

    # --- commands to jobs ----------------------------------------------------------------

    async def send(self, job_id: str, command: Outgoing | Wire, *, ranks: Iterable[int] | None = None) -> bool:
        """Send a command (one of mscale.link's, e.g. `Heal`, or a plugin's dict with a "type")
        to a connected job's ranks (`ranks`: only those, e.g. the ranks whose MPU is on a faulty
        GPU); False if none of them is there."""
        if not isinstance(command, dict):
            command = command.to_wire()
        protocol.check_command(command)
        only = None if ranks is None else set(ranks)
        job = self.state.jobs.get(job_id)
        sent = False
        for rank, ws in list(self.connections.get(job_id, {}).items()):
            if ws.closed or (only is not None and rank not in only):
                continue
            if job is None or job.uid is None or self.peer_uids.get(ws) != job.uid:
                log.warning("command_not_sent", job_id=job_id, rank=rank, error="not the job owner's connection")
                continue
            try:
                await ws.send_str(protocol.encode(command))
                sent = True
            except (ConnectionError, RuntimeError) as e:
                log.warning("command_not_sent", job_id=job_id, rank=rank, error=str(e))
        return sent

    async def broadcast(self, command: Outgoing | Wire) -> int:
        sent = await asyncio.gather(*(self.send(j, command) for j in list(self.connections)))
        return sum(sent)

    def on_message(self, type_: str, handler: Handler, *, with_rank: bool = False) -> None:
        """Handle another message type from jobs (e.g. a plugin's); handler(job, msg), or
        handler(job, msg, rank) with the sending connection's rank when with_rank."""
        if type_ in protocol.RESERVED:
            raise ValueError(f"{type_!r} is the link's own message type")
        self.handlers[type_] = handler
        self._with_rank[type_] = with_rank

    def on_report(self, fn: ReportObserver) -> None:
        """Call fn(job, rank, step_report) for every step report applied (mscale.daemon.stragglers)."""
        self.report_observers.append(fn)

    # --- serving ---------------------------------------------------------------------------

    async def start(self) -> bool:
        path = Path(self.path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            socket_file.check_directory(path.parent)
            if path.exists() or path.is_symlink():
                if not stat.S_ISSOCK(path.lstat().st_mode):
                    raise OSError(f"{path} exists and is not a socket")
                if await socket_file.in_use(str(path)):
                    raise OSError(f"{path} is in use by another agent")
                path.unlink()  # stale, from an agent that died
            link_app = web.Application()
            link_app.router.add_get(protocol.PATH, self._handle)
            self._runner = web.AppRunner(link_app, access_log=None, handle_signals=False)
            await self._runner.setup()
            # created with its mode, no chmod of a path another user could swap (socket_file)
            sock = socket_file.bind(str(path), self.config.socket.mode)
            limits = LinkLimits(self.config, self.state, self.allowed_uids)  # uid and count gate (link_gate)
            await GatedSockSite(self._runner, sock, limits).start()
        except OSError as e:
            self.error = str(e)
            log.error("link_socket_unavailable", socket=str(path), error=self.error)
            if self._runner is not None:
                await self._runner.cleanup()
                self._runner = None
            return False
        log.info("link_listening", socket=str(path), mode=oct(self.config.socket.mode))
        self._sweeper = asyncio.ensure_future(self._sweep())
        self.intake.start()
        return True

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        await self.intake.stop()
        for ranks in list(self.connections.values()):
            for ws in list(ranks.values()):
                await ws.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    # --- bounded state ---------------------------------------------------------------------

    def expire(self, now: float | None = None) -> list[str]:
        """Remove the jobs whose last rank left `socket.job_expiry_s` ago (their series go with
        them); the ids removed."""
        now = time.monotonic() if now is None else now
        ttl = self.config.socket.job_expiry_s
        gone = [
            job_id
            for job_id, job in list(self.state.jobs.items())
            if not job.ranks and job.disconnected_at is not None and now - job.disconnected_at >= ttl
        ]
        for job_id in gone:
            self._drop(job_id, "expired")
        return gone

    def _drop(self, job_id: str, why: str) -> None:
        job = self.state.jobs.pop(job_id, None)
        self.connections.pop(job_id, None)
        if job is None:
            return
        self.state.jobs_expired += 1
        log.info("job_expired", job_id=job_id, why=why)

    async def _sweep(self) -> None:
        interval = min(max(self.config.socket.job_expiry_s / 4, 0.05), 5.0)
        while True:
            await asyncio.sleep(interval)
            self.expire()

    # --- messages ----------------------------------------------------------------------------

    def _shed(self) -> None:
        self.state.reports_shed += 1

    def _refuse(self, why: str, detail: str, **labels: Any) -> None:
        self.state.refused[("socket", why)] += 1
        log.warning("link_message_refused", why=why, detail=detail[:300], **labels)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        cred = peer_uid(request)
        if cred is None or cred[1] not in self.allowed_uids:
            self._refuse(
                "peer_uid", f"peer uid {cred[1] if cred else '?'} not allowed", peer_pid=cred[0] if cred else 0
            )
            return web.Response(status=403, text="uid not allowed on the mscale socket\n")
        limit = self.config.socket.max_message_bytes
        # aiohttp reads a frame up to twice the limit, so that a message over the limit gets its
        # error frame and the connection goes on; past that it cannot be read (closed, 1009)
        ws = web.WebSocketResponse(max_msg_size=2 * limit, heartbeat=30.0)
        await ws.prepare(request)
        conn = _Conn(ws, pid=cred[0], uid=cred[1])
        self.peer_uids[ws] = conn.uid
        timeout_s = self.config.socket.register_timeout_s
        unregistered = asyncio.get_running_loop().call_later(timeout_s, self._unregistered, conn, request)
        inbox = Inbox(conn)
        try:
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    if not await self.intake.put(inbox, msg.data):  # handled in turn (link_intake)
                        self._refuse("backlog", "no room for the frame", job_id=conn.job.job_id if conn.job else "")
                elif msg.type == WSMsgType.BINARY:
                    self._refuse("malformed", "binary frame")
                    await ws.send_str(protocol.encode(Error("binary frames are not accepted").to_wire()))
                elif msg.type == WSMsgType.ERROR:
                    exc = ws.exception()
                    why = (
                        "oversized" if "too big" in str(exc).lower() or getattr(exc, "code", 0) == 1009 else "malformed"
                    )
                    self._refuse(why, str(exc), job_id=conn.job.job_id if conn.job else "")
                    break
            await self.intake.drained(inbox)  # what it sent before it left still counts
        finally:
            unregistered.cancel()
            self.peer_uids.pop(ws, None)
            self._disconnected(conn)
        return ws

    async def _frame(self, conn: _Conn, data: str) -> None:
        """One text frame, in the intake's turn: a refusal is counted and answered."""
        ws = conn.ws
        try:
            await self._message(conn, data)
        except BadMessage as e:
            self._refuse(e.why, str(e), job_id=conn.job.job_id if conn.job else "", uid=conn.uid)
            await _answer(ws, Error(str(e)).to_wire())
        except Exception as e:  # a validator's gap: refused and counted, the connection goes on
            log.error("link_message_failed", error=f"{type(e).__name__}: {e}"[:300], uid=conn.uid)
            self._refuse("internal", f"{type(e).__name__}", job_id=conn.job.job_id if conn.job else "")
            await _answer(ws, Error(f"not understood ({type(e).__name__})").to_wire())

    def _unregistered(self, conn: _Conn, request: web.Request) -> None:
        """A connection that registered no job within socket.register_timeout_s (it sent
        nothing, or began a frame and never finished it) is closed: it holds a descriptor."""
        if conn.job is None and request.transport is not None:
            self._refuse("register_timeout", f"no registration within {self.config.socket.register_timeout_s:g} s")
            request.transport.abort()

    def _disconnected(self, conn: _Conn) -> None:
        job = conn.job
        if job is None:
            return
        live = self.connections.get(job.job_id, {})
        if live.get(conn.rank) is not conn.ws:
            return  # replaced by the same process reconnecting, or the job already expired
        del live[conn.rank]
        job.ranks.pop(conn.rank, None)
        job.disconnect(conn.rank)
        if live:
            return
        self.connections.pop(job.job_id, None)
        job.connected = False
        job.disconnected_at = time.monotonic()
        self.state.events.emit(
            Finding(
                "link",
                Reason.JOB_GONE,
                Severity.WARNING,
                f"job {job.job_id} disconnected",
                {"job_id": job.job_id},
            )
        )

    async def _message(self, conn: _Conn, data: str) -> None:
        msg, report = read_frame(data, self.config.socket.max_message_bytes)
        kind = msg["type"]
        if kind == Msg.REGISTER:
            registered = self._register(conn, Register.from_wire(msg, self.config.socket.max_mpus_per_job))
            await _answer(conn.ws, Registered(registered.job_id, self.state.node).to_wire())
            return
        job = conn.job
        if job is None or not self._current(job):  # never registered, or expired meanwhile
            raise BadMessage("unregistered", f"{str(kind)[:64]}: register first")
        if kind == Msg.REPORT:
            if msg.get("job_id") != job.job_id:
                raise BadMessage(
                    "malformed", f"report: job_id {str(msg.get('job_id'))[:140]!r} is not this connection's job"
                )
            if isinstance(report, BadMessage):
                raise report
            assert report is not None
            self._report(job, conn.rank, report)
        elif kind in self.handlers:
            try:
                handler: Any = self.handlers[kind]
                result = handler(job, msg, conn.rank) if self._with_rank.get(kind) else handler(job, msg)
                if asyncio.iscoroutine(result):
                    await result
            except BadMessage:  # the handler's own validator refused it: keep its reason
                raise
            except Exception as e:  # a plugin's handler failing must not end the connection
                log.error("link_handler_failed", type=kind, job_id=job.job_id, error=f"{type(e).__name__}: {e}")
                raise BadMessage("handler_error", f"{kind}: not handled ({type(e).__name__})") from None
        elif kind not in protocol.ACCEPTED_SILENTLY:
            raise BadMessage("unknown_type", f"unknown message type {kind!r}")

    def _current(self, job: JobState) -> bool:
        return self.state.jobs.get(job.job_id) is job

    def _register(self, conn: _Conn, msg: Register) -> JobState:
        """Check the registration against the job's owner, its live ranks and the caps, then
        apply it; a refusal (BadMessage) changes nothing."""
        job_id, rank = msg.job_id, msg.rank
        if conn.job is not None and (conn.job.job_id, conn.rank) != (job_id, rank):
            raise BadMessage(
                "identity",
                f"register: this connection is job {conn.job.job_id} rank {conn.rank}; "
                "a re-registration keeps job_id and rank",
            )
        # the peer's PID as this kernel namespace sees it (the eBPF probe traces it)
        msg = dataclasses.replace(msg, pid=conn.pid or msg.pid)
        if not self.config.kubernetes.enabled:
            msg = dataclasses.replace(msg, pod=None)  # pod labels only on Kubernetes (mscale.kube)
        old = self.connections.get(job_id, {}).get(rank)
        job = self._admitted(conn, msg, self.state.jobs.get(job_id), old)
        if job.uid is None:
            job.uid = conn.uid
        if old is not None and old is not conn.ws and not old.closed:
            asyncio.ensure_future(old.close())  # the same process reconnected; its old link is dead to us
        first = old is not conn.ws
        job.ranks[rank] = msg.pid
        job.connected, job.disconnected_at = True, None
        job.refresh(gpus_by_index(self.state))
        self.connections.setdefault(job_id, {})[rank] = conn.ws
        conn.job, conn.rank = job, rank
        if first:
            rs = job.rank_state(rank)
            self.state.events.emit(
                Finding(
                    "link",
                    Reason.JOB_REGISTERED,
                    Severity.INFO,
                    f"job {job_id} rank {rank} (local {rs.local_rank} of world {rs.world_size}) pid {rs.pid}: "
                    + ", ".join(f"{m.mpu_id}={m.name}@gpu{m.gpu}" for m in rs.mpus.values()),
                    {"job_id": job_id, "rank": str(rank), "local_rank": str(rs.local_rank), "pid": str(rs.pid)},
                )
            )
        return job

    def _admitted(
        self, conn: _Conn, msg: Register, job: JobState | None, old: web.WebSocketResponse | None
    ) -> JobState:
        """The job with this registration in it (made when new), or BadMessage: another
        user's job, a rank already connected from another process, past a cap."""
        job_id, rank = msg.job_id, msg.rank
        live = self.connections.get(job_id, {})
        if job is not None and job.uid is not None and job.uid != conn.uid:
            raise BadMessage("job_owner", f"register: job {job_id} belongs to another user (uid {job.uid})")
        if old is not None and old is not conn.ws and not old.closed and job is not None:
            if job.ranks.get(rank) != msg.pid:
                raise BadMessage(
                    "duplicate",
                    f"register: job {job_id} rank {rank} is already connected (pid {job.ranks.get(rank)})",
                )
        elif old is None and len(live) >= self.config.socket.max_ranks_per_job:
            raise BadMessage(
                "rank_limit", f"register: job {job_id} has {len(live)} ranks connected (socket.max_ranks_per_job)"
            )
        check_mpu_budget(self.config.socket, self.state.jobs, conn.uid, job, msg, self._drop)
        if job is None:
            make_room(self.config.socket, self.state.jobs, conn.uid, self._drop)
            job = JobState(
                job_id=job_id, rank=rank, pid=msg.pid, uid=conn.uid, max_ranks=self.config.socket.max_ranks_per_job
            )
            job.register(msg)
            self.state.jobs[job_id] = job
            return job
        try:
            job.register(msg)
        except RankLimit as e:
            raise BadMessage("rank_limit", f"register: {e} (socket.max_ranks_per_job)") from None
        if old is not conn.ws:
            job.connects += 1
        return job

    def _report(self, job: JobState, rank: int, msg: Report) -> None:
        gpus = gpus_by_index(self.state)
        rs = job.rank_state(rank)
        rs.reports_dropped = max(rs.reports_dropped, msg.dropped)
        proofs = 0
        last = len(msg.reports) - 1
        for i, r in enumerate(msg.reports):
            rs.apply_report(r, gpus, score=i == last)  # scored once a message: coalesced
            for observe in self.report_observers:
                try:
                    observe(job, rank, r)
                except Exception as e:  # an observer's bug must not stop the job's reports
                    log.exception("report_observer_failed", job_id=job.job_id, error=str(e)[:300])
            for bad in r.refused_findings:
                self._refuse("bad_finding", f"finding not understood: {bad}", job_id=job.job_id)
            for f in r.findings:
                if f.reason in PROOFS:
                    proofs += 1
                    if proofs > MAX_PROOFS_PER_MESSAGE:
                        continue  # refused below, counted each, logged once
                self._finding(job, rank, f, gpus)
        if proofs > MAX_PROOFS_PER_MESSAGE:
            over = proofs - MAX_PROOFS_PER_MESSAGE
            self.state.refused[("socket", "proof_limit")] += over - 1
            self._refuse(
                "proof_limit",
                f"{over} heal_action/fuse_state findings past {MAX_PROOFS_PER_MESSAGE} in one message",
                job_id=job.job_id,
            )

    def _finding(self, job: JobState, rank: int, f: Finding, gpus: Any) -> None:
        finding = labelled(job, rank, f, gpus)
        if finding is None:
            mpu = f.labels.get("mpu_id", "")[:16]
            self._refuse(
                "unregistered_mpu",
                f"{f.reason.value} about MPU {mpu!r}, not registered by rank {rank}",
                job_id=job.job_id,
            )
        elif not job.observe_finding(finding):
            self._refuse("finding_limit", f"finding {finding.source}/{finding.reason.value}", job_id=job.job_id)
        else:
            self.state.events.emit(finding)


async def _answer(ws: web.WebSocketResponse, wire: Wire) -> None:
    """An answer from the intake's one task: a peer that does not read holds it this long at most."""
    try:
        async with asyncio.timeout(ANSWER_TIMEOUT_S):
            await ws.send_str(protocol.encode(wire))
    except (TimeoutError, ConnectionError, RuntimeError) as e:
        log.warning("link_answer_not_sent", error=f"{type(e).__name__}: {e}"[:200])


class Outgoing(Protocol):
    """A message the agent sends (mscale.link's command and answer classes)."""

    def to_wire(self) -> Wire: ...


@dataclasses.dataclass
class _Conn:
    """One connection: its websocket, the peer's credentials, and the (job, rank) it registered."""

    ws: web.WebSocketResponse
    pid: int
    uid: int
    job: JobState | None = None
    rank: int = -1


def setup(app: web.Application) -> None:
    app[keys.LINK] = LinkServer(app)
    app.cleanup_ctx.append(_serve)


async def _serve(app: web.Application) -> AsyncIterator[None]:
    server = app[keys.LINK]
    await server.start()
    yield
    await server.stop()

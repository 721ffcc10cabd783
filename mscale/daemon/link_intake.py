"""The link's intake: every connection's frames, handled one per event-loop turn.

A connection's reader (mscale.daemon.link) only appends each text frame to its `Inbox`; one
task, the intake's, takes the frames, a connection at a time in turn (each connection's in the
order they came), and hands each to the link's handler (decode, check, apply), then gives the
loop a turn (`asyncio.sleep(0)`) before the next. So report work never holds the event loop
longer than one message (a report of 5 steps x 16 MPUs: about 0.8 ms), and a `/healthz` probe
or a scrape waits at most that between its own steps, however many reports are waiting. Not
a thread: decoding in a worker thread took the GIL from the loop in 5 ms slices (a probe that
needs several turns then waits several slices), and let one connection's frames run far ahead
of another's.

When the agent is behind, report work is shed, not the probes: a connection holds at most
`MAX_QUEUED` frames; a frame past that drops the connection's oldest waiting *report* frame
that carries no findings (superseded: the newer frames carry the MPUs' newer steps), counted
in `shed` (and `on_shed`: mscale_link_reports_shed_total). A frame with findings (or one that is not a report) is never dropped: when all the
waiting frames are such frames, the reader waits for room (the socket backs up to the job,
whose own bounded queue drops its oldest reports and counts them, mscale_job_reports_dropped).
Whether a frame is a report and carries findings is read off its text without decoding it
(a report's wire form has `"type": "report"`, a finding `"reason"`; a frame that merely looks
like one is only ever shed when a newer frame of the same connection waits behind it).
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from mscale import link as protocol
from mscale.link import BadMessage, Msg, Report, Wire

log = structlog.get_logger("mscale.link")

MAX_QUEUED = 8  # frames waiting per connection before its oldest superseded report is shed
ROOM_WAIT_S = 30.0  # a reader waits this long for room at most, then the frame is refused
_REPORT = re.compile(r'"type"\s*:\s*"report"')


def sheddable(data: str) -> bool:
    """A report frame without findings: a newer one of the same connection supersedes it."""
    return '"reason"' not in data and _REPORT.search(data) is not None


def read_frame(data: str, limit: int) -> tuple[Wire, Report | BadMessage | None]:
    """A frame as a message and, for a report, the report checked (or why not: raised once the
    connection is known to be registered)."""
    msg = protocol.decode(data, limit)
    if msg["type"] != Msg.REPORT:
        return msg, None
    try:
        return msg, Report.from_wire(msg)
    except BadMessage as e:
        return msg, e


class Inbox:
    """One connection's waiting frames (text, and whether it may be shed)."""

    __slots__ = ("conn", "frames", "queued", "room", "empty")

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.frames: deque[tuple[str, bool]] = deque()
        self.queued = False  # in the intake's turn order
        self.room = asyncio.Event()
        self.empty = asyncio.Event()
        self.empty.set()


class Intake:
    """The frames of every connection, to `handle(conn, text)` one per loop turn."""

    def __init__(
        self, handle: Callable[[Any, str], Awaitable[None]], on_shed: Callable[[], None] | None = None
    ) -> None:
        self.handle = handle
        self.on_shed = on_shed  # counts a shed frame where the metrics see it (state.reports_shed)
        self.turns: deque[Inbox] = deque()  # connections with frames waiting, in turn
        self.wake = asyncio.Event()
        self.shed = 0  # report frames dropped, superseded by newer ones of their connection
        self.refused = 0  # frames refused: no room within ROOM_WAIT_S
        self.handled = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def put(self, inbox: Inbox, data: str) -> bool:
        """Queue a frame (False: refused, no room in time); past MAX_QUEUED the oldest
        superseded report is shed, or the reader waits for room."""
        while len(inbox.frames) >= MAX_QUEUED:
            old = next((i for i, (_, ok) in enumerate(inbox.frames) if ok), None)
            if old is not None:
                del inbox.frames[old]
                self.shed += 1
                if self.on_shed is not None:
                    self.on_shed()
                break
            inbox.room.clear()
            try:
                async with asyncio.timeout(ROOM_WAIT_S):
                    await inbox.room.wait()
            except TimeoutError:
                self.refused += 1
                return False
        inbox.frames.append((data, sheddable(data)))
        inbox.empty.clear()
        if not inbox.queued:
            inbox.queued = True
            self.turns.append(inbox)
            self.wake.set()
        return True

    async def drained(self, inbox: Inbox, timeout_s: float = ROOM_WAIT_S) -> None:
        """Wait until the connection's waiting frames are handled (it closed: they still count)."""
        try:
            async with asyncio.timeout(timeout_s):
                await inbox.empty.wait()
        except TimeoutError:
            log.warning("link_frames_left", frames=len(inbox.frames))
            inbox.frames.clear()

    async def _run(self) -> None:
        while True:
            if not self.turns:
                self.wake.clear()
                await self.wake.wait()
                continue
            inbox = self.turns.popleft()
            if not inbox.frames:
                inbox.queued = False
                inbox.empty.set()
                continue
            data, _ = inbox.frames.popleft()
            inbox.room.set()
            if inbox.frames:
                self.turns.append(inbox)  # its next frame after the other connections' turns
            else:
                inbox.queued = False
            try:
                await self.handle(inbox.conn, data)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the handler answers its own errors; this is its gap
                log.error("link_intake_failed", error=f"{type(e).__name__}: {e}"[:300])
            self.handled += 1
            if not inbox.frames and not inbox.queued:
                inbox.empty.set()
            await asyncio.sleep(0)  # the loop's other work (probes, scrapes) gets its turn

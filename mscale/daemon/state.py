"""The agent's live model: latest probe snapshots, probe status, events, jobs.

Probes publish immutable snapshots; collectors and the API only read them, so a scrape
never touches hardware. `EventLog.emit` is thread-safe (probes run in worker threads).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from mscale.daemon.gpus import gpus_by_index
from mscale.daemon.jobs import JobState
from mscale.findings import Finding, Severity

log = structlog.get_logger("mscale.events")

_LOG_METHOD = {Severity.CRITICAL: "error", Severity.WARNING: "warning", Severity.INFO: "info"}


@dataclass
class ProbeStatus:
    name: str
    enabled: bool = True
    up: bool | None = None  # None: not sampled yet
    reason: str = ""
    last_success_time: float = 0.0
    last_duration_s: float = 0.0
    samples_total: int = 0
    errors_total: int = 0

    def to_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def finding_bytes(f: Finding) -> int:
    """What a finding costs the history, roughly: its strings plus a fixed overhead."""
    return 200 + len(f.source) + len(f.message) + sum(len(k) + len(v) + 8 for k, v in f.labels.items())


class JobLogLimit:
    """At most `burst` log lines per (job, source, reason) every `window_s`: one job's flood of
    findings must not fill the journal (72 MiB in 31 s, once). Lines past it are dropped and
    counted; the key's next line logged says how many (`dropped`). Every finding is still
    kept, counted and handed to the healing engine: only its log line is dropped."""

    def __init__(self, burst: int = 20, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.window_s, self.clock = burst, window_s, clock
        self._windows: dict[tuple[str, str, str], list[float]] = {}  # key -> [window start, lines, dropped]
        self.dropped_total = 0

    def admit(self, key: tuple[str, str, str]) -> int | None:
        """None: drop this line; else log it, with the number dropped before it."""
        now = self.clock()
        w = self._windows.get(key)
        if w is None or now - w[0] >= self.window_s:
            if w is None and len(self._windows) >= 4096:  # bounded: forget the oldest windows
                for k in sorted(self._windows, key=lambda k: self._windows[k][0])[:1024]:
                    del self._windows[k]
            dropped = int(w[2]) if w is not None else 0
            self._windows[key] = [now, 1, 0]
            return dropped
        if w[1] >= self.burst:
            w[2] += 1
            self.dropped_total += 1
            return None
        w[1] += 1
        return 0


class EventLog:
    """History of findings bounded in count (`maxlen`) and in bytes (`max_bytes`, by
    `finding_bytes`; the oldest go first), a counter per (source, reason, severity), subscribers;
    the log lines of a job's findings rate-limited per job and reason (JobLogLimit)."""

    def __init__(self, maxlen: int = 1000, max_bytes: int = 16 << 20, log_limit: JobLogLimit | None = None) -> None:
        self.log_limit = log_limit or JobLogLimit()
        self._lock = threading.Lock()
        self._items: deque[tuple[int, Finding]] = deque()
        self.maxlen, self.max_bytes = maxlen, max_bytes
        self.bytes = 0  # finding_bytes of the history now
        self._seq = itertools.count(1)
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self._subscribers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[Finding]]] = []
        self._sync_subscribers: list[Callable[[Finding], None]] = []

    def emit(self, finding: Finding) -> int:
        with self._lock:
            seq = next(self._seq)
            self._items.append((seq, finding))
            self.bytes += finding_bytes(finding)
            while len(self._items) > self.maxlen or (self.bytes > self.max_bytes and len(self._items) > 1):
                self.bytes -= finding_bytes(self._items.popleft()[1])
            self.counts[(finding.source, finding.reason.value, finding.severity.value)] += 1
            subs = list(self._subscribers)
            sync_subs = list(self._sync_subscribers)
            job = finding.labels.get("job_id")
            dropped = 0 if job is None else self.log_limit.admit((job, finding.source, finding.reason.value))
        if dropped is not None:
            extra = {"dropped": dropped} if dropped else {}
            # labels nested, never spread: a label named source, message, seq, event or level is data
            getattr(log, _LOG_METHOD[finding.severity])(
                finding.reason.value,
                source=finding.source,
                message=finding.message,
                seq=seq,
                labels=dict(finding.labels),
                **extra,
            )
        for loop, queue in subs:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, finding)
            except RuntimeError:  # loop closed
                pass
        for fn in sync_subs:
            fn(finding)
        return seq

    def subscribe(self, loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Queue[Finding]:
        """An unbounded queue receiving every finding emitted from now on."""
        loop = loop or asyncio.get_running_loop()
        queue: asyncio.Queue[Finding] = asyncio.Queue()
        with self._lock:
            self._subscribers.append((loop, queue))
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Finding]) -> None:
        with self._lock:
            self._subscribers = [(lp, q) for lp, q in self._subscribers if q is not queue]

    def on_emit(self, fn: Callable[[Finding], None]) -> None:
        """Call `fn` synchronously (in the emitting thread) for every finding."""
        with self._lock:
            self._sync_subscribers.append(fn)

    def since(self, seq: int = 0, limit: int = 1000) -> list[tuple[int, Finding]]:
        with self._lock:
            items = [(s, f) for s, f in self._items if s > seq]
        return items[-limit:]


@dataclass
class AgentState:
    node: str
    events: EventLog = field(default_factory=EventLog)
    started_at: float = field(default_factory=time.time)
    # probe name -> latest immutable snapshot the probe published
    snapshots: dict[str, Any] = field(default_factory=dict)
    probe_status: dict[str, ProbeStatus] = field(default_factory=dict)
    # job id -> the link's per-job state (mscale.daemon.link)
    jobs: dict[str, JobState] = field(default_factory=dict)
    # refused or dropped input, by (where, why): webhook, socket, chaos API
    refused: Counter[tuple[str, str]] = field(default_factory=Counter)
    jobs_expired: int = 0  # jobs removed after socket.job_expiry_s (or early, to stay under socket.max_jobs)
    reports_shed: int = 0  # report frames the link dropped, superseded, while behind (mscale.daemon.link_intake)

    def publish(self, probe: str, snapshot: Any) -> None:
        self.snapshots[probe] = snapshot
        if probe == "gpu":  # the bound GPU's health is part of each MPU's score: scored now, never at a scrape
            gpus = gpus_by_index(self)
            for job in self.jobs.values():
                job.refresh(gpus)

    def registered_jobs(self) -> list[JobState]:
        """The jobs now, copied from a probe's worker thread (what the probes that follow the
        training processes read, mscale.probes.base.ProbeContext.jobs): the event loop may add
        a job while it is copied, so the copy is tried again; [] after three tries."""
        for _ in range(3):
            try:
                return list(self.jobs.values())
            except RuntimeError:
                continue
        return []

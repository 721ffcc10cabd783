"""Hang and sync-stall judgement for one traced process, from what the BPF maps say.

Pure logic over monotonic times (seconds, the clock bpf_ktime_get_ns reads), so it is
tested without BPF. probes/ebpf.py feeds it attach/detach times, launch times and the
cumulative time blocked in synchronise calls.
"""

from __future__ import annotations

import math
from collections import deque


class LaunchWatch:
    """Is a process that launches kernels still launching?

    The launch probe is duty-cycled, so "no launch seen" only means something over the
    time it was attached. A hang needs both: more than `hang_timeout_s` since the last
    launch seen, and at least `min_evidence_s` of attached time since then in which none
    was seen (one whole window, or the timeout if shorter). A process never seen launching
    is not judged (it may still be loading data or compiling).
    """

    def __init__(self, *, hang_timeout_s: float, min_evidence_s: float, max_windows: int = 1024) -> None:
        self.hang_timeout_s = hang_timeout_s
        self.min_evidence_s = min(min_evidence_s, hang_timeout_s)
        self.windows: deque[list[float]] = deque(maxlen=max_windows)  # [start, end]; end inf while attached
        self.last_launch: float | None = None

    def attached(self, t: float) -> None:
        if not self.windows or self.windows[-1][1] != math.inf:
            self.windows.append([t, math.inf])

    def detached(self, t: float) -> None:
        if self.windows and self.windows[-1][1] == math.inf:
            self.windows[-1][1] = t

    @property
    def is_attached(self) -> bool:
        return bool(self.windows) and self.windows[-1][1] == math.inf

    def launched(self, t: float) -> None:
        if self.last_launch is None or t > self.last_launch:
            self.last_launch = t
        while len(self.windows) > 1 and self.windows[0][1] <= t:  # before the launch: no evidence
            self.windows.popleft()

    def quiet_s(self, now: float) -> float | None:
        return None if self.last_launch is None else max(0.0, now - self.last_launch)

    def evidence_s(self, now: float) -> float:
        """Attached time since the last launch seen."""
        since = self.last_launch if self.last_launch is not None else -math.inf
        return sum(max(0.0, min(end, now) - max(start, since)) for start, end in self.windows)

    def hung(self, now: float) -> bool:
        quiet = self.quiet_s(now)
        return quiet is not None and quiet > self.hang_timeout_s and self.evidence_s(now) >= self.min_evidence_s


class BlockedShare:
    """Share of wall time spent blocked in synchronise calls over a sliding window.

    Fed the cumulative blocked time (completed calls plus the elapsed part of calls still in
    flight), summed over threads; the share is capped at 1. None until a whole window has
    been seen.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.history: deque[tuple[float, float]] = deque()

    def add(self, t: float, blocked_s: float) -> None:
        self.history.append((t, blocked_s))
        while len(self.history) > 1 and self.history[1][0] <= t - self.window_s:
            self.history.popleft()

    def ratio(self) -> float | None:
        if len(self.history) < 2:
            return None
        (t0, b0), (t1, b1) = self.history[0], self.history[-1]
        if t1 - t0 < self.window_s:
            return None
        return min(1.0, max(0.0, (b1 - b0) / (t1 - t0)))

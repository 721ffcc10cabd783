"""Goodput and badput: where each second of a rank's wall time went, by cause.

A guard plugin (`attach` adds it). The rank's time from attach to the end of its last step is
cut at step boundaries into contiguous intervals, so the causes add up to the wall time:

    startup     attach to the first step's begin: hooking, the resume from a disk snapshot
    data_wait   between a step's end and the next one's begin: the loader, the user's loop
    snapshot    in-memory snapshots and restores the step waited on (SnapshotEngine.stall_s)
    checks      the guard's checksums and replays in the step (StepTimes abft_s + replay_s)
    rerun       a step whose update was dropped (its work is redone), or a step already done
                once that runs again after a rollback
    degraded    the rest of a step run while an MPU is degraded or distilled (L2/L3): it
                trains, at a cost
    hang        of a step or a gap longer than max(HANG_FACTOR x the median of the recent ones,
                HANG_MIN_S), the part beyond that median
    productive  the rest of a step that trained normally

Each step report carries the seconds since the last report (`seconds`, mscale.link
TIME_CAUSES); `totals` holds the rank's own sums (the demo prints them).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from mscale.link import TIME_CAUSES, StepReport

if TYPE_CHECKING:
    from mscale.hook.core.guard import Guard

HANG_FACTOR = 10.0
HANG_MIN_S = 1.0
RECENT = 50  # steps and gaps the hang threshold's medians are taken over
DEGRADED_LEVELS = ("l2_degraded", "l3_distilling")


class GoodputAccountant:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.guard: Guard | None = None
        self.totals: dict[str, float] = {c: 0.0 for c in TIME_CAUSES}
        self.pending: dict[str, float] = {}
        self.started_at = self.last_end = 0.0
        self.step_begin: float | None = None
        self.steps = 0  # steps accounted, re-runs included
        self.done_upto = -1  # the highest step whose update was kept
        self._stall = self._checks = 0.0
        self._steps: deque[float] = deque(maxlen=RECENT)
        self._gaps: deque[float] = deque(maxlen=RECENT)

    @property
    def wall_s(self) -> float:
        return sum(self.totals.values())

    def on_attach(self, guard: Guard) -> None:
        self.guard = guard
        self.started_at = self.last_end = self.clock()
        self._stall = self._engine_stall()

    def _engine_stall(self) -> float:
        for p in self.guard.plugins if self.guard is not None else ():
            engine = getattr(p, "snapshot_engine", None)
            if engine is not None:
                return float(getattr(engine, "stall_s", 0.0))
        return 0.0

    def _add(self, cause: str, seconds: float) -> None:
        if seconds > 0:
            self.totals[cause] += seconds
            self.pending[cause] = self.pending.get(cause, 0.0) + seconds

    def _hang_part(self, seconds: float, recent: deque[float]) -> float:
        if len(recent) < 5:
            return 0.0
        median = statistics.median(recent)
        return seconds - median if seconds > max(HANG_FACTOR * median, HANG_MIN_S) else 0.0

    def on_step_begin(self, step: int, batch: object) -> None:
        now = self.clock()
        gap = now - self.last_end
        if self.steps == 0:
            self._add("startup", gap)
        else:
            hang = self._hang_part(gap, self._gaps)
            self._add("hang", hang)
            self._add("data_wait", gap - hang)
            self._gaps.append(gap - hang)
        self.step_begin = now

    def on_report(self, report: StepReport) -> None:
        guard = self.guard
        if guard is None:  # reports come only from the guard it is attached to
            return
        now = self.clock()
        begin = self.step_begin if self.step_begin is not None else self.last_end
        seconds = now - begin
        stall = self._engine_stall()
        snapshot = min(seconds, max(0.0, stall - self._stall))
        self._stall = stall
        times = guard.times
        checks = min(seconds - snapshot, max(0.0, times.abft_s + times.replay_s))
        rest = seconds - snapshot - checks
        hang = self._hang_part(rest, self._steps)
        rest -= hang
        step = report.step
        if report.skipped or step <= self.done_upto:
            cause = "rerun"
        elif any(m.fuse_level in DEGRADED_LEVELS for m in guard.mpus):
            cause = "degraded"
        else:
            cause = "productive"
        if not report.skipped:
            self.done_upto = max(self.done_upto, step)
        for c, v in (("snapshot", snapshot), ("checks", checks), ("hang", hang), (cause, rest)):
            self._add(c, v)
        self._steps.append(rest)
        self.steps += 1
        self.step_begin, self.last_end = None, now
        report.seconds = {c: round(v, 9) for c, v in self.pending.items() if v > 0}
        self.pending.clear()

    def breakdown(self) -> list[tuple[str, float, float]]:
        """(cause, seconds, share of the wall time) for every cause, productive first."""
        wall = self.wall_s
        return [(c, self.totals[c], self.totals[c] / wall if wall else 0.0) for c in TIME_CAUSES]


def account(guard: Guard) -> GoodputAccountant:
    """Add the accountant to a guard (attach does)."""
    acc = GoodputAccountant()
    guard.add_plugin(acc)
    return acc

"""The guard's budget: the share of each training step its detectors may spend.

    budget = Budget(share=0.01)            # the guard owns one (guard.budget)
    with budget.timer("checksum", device): # a detector times its own work ...
        ...
    budget.charge("weights", seconds)      # ... or charges what it measured itself
    budget.allowance_s("checksum")         # seconds it may spend next step
    budget.end_step(step_s)                # the guard, once a step, at its end

What it measures. A detector's cost is the time of the work it does inside the step: host
timers (`time.perf_counter`) on a CPU, CUDA events on a GPU (a host timer there measures only
the launch, not the kernels). CUDA events are resolved when they have completed, a step or
more later, with `Event.query()`, never `synchronize()`, so timing adds no host sync. The step
time is the host wall time of the guard's step, from its first forward (`step_began`) to its
end (optimizer step or scaler update), checks included: the loop's data loading and whatever
else it does between steps are left out, so the allowance is never bought with time the guard
does not ride on (a benchmark interleaving arms, an evaluation between steps).

Everything the guard does counts. Besides what detectors time or charge themselves, every
entry point through which torch calls the guard (module and MPU hooks, the linear layers'
hooks, backward hooks, the optimizer hooks) is timed whole with `enter`/`leave`: its host time,
less what was charged inside it, goes to "guard". So hook bookkeeping, plugins (the fuse, the
goodput accountant, the gradient check) and early returns are in the measured ratio, not only
the checks. (On a GPU the host time of a block timed with CUDA events is charged as well: a
conservative double count of launches.)

How it shares. Each detector's cost per step is smoothed (an exponential moving average,
`smoothing`); the allowance of one detector is the aim, `(1 - headroom) * share * step time`,
minus what the others spent on average, never below zero. The budget is a ceiling, not a
target: a plan that spent all of it would exceed it whenever its estimates read low
(ChecksumConfig.headroom). A detector decides how much work to do from its allowance and its
own cost estimates (the checksum detector: how many linear layers to check, see
mscale.hook.checks.coverage). Work a detector must do whatever the budget (the checksum's floor that
keeps every layer within `max_gap_steps`, an incident's full coverage) is charged all the
same, so the measured ratio is honest: `overhead_ratio` (smoothed) and `last_ratio` (the last
step) are what the guard reports, never what was planned.

Not counted: work off the training thread (the snapshot copy), and the step's own compute.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

from mscale.hook.integrations.compiled import compiling

T = TypeVar("T")

SMOOTHING = 0.2  # weight of the newest step in the moving averages
MAX_OPEN = 64  # entries open at once (nesting depth, a bound: a mark left open is dropped at 64)
MAX_PENDING_EVENTS = 4096  # CUDA event pairs waiting to complete (a bound, not a working size)


@dataclass
class StepTimes:
    """Seconds spent in the guard's own work during the last step, by part (benchmarks)."""

    abft_s: float = 0.0
    replay_s: float = 0.0
    hooks_s: float = 0.0  # the guard's own MPU forward-hook work around the checksums
    grad_stats_s: float = 0.0
    loss_s: float = 0.0
    cmsa_s: float = 0.0
    report_s: float = 0.0
    plugins_s: float = 0.0

    def reset(self) -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, 0.0)


# An entry point open now (`Budget.enter`): whose time it is, and [when it started, what had been
# charged by then], restarted in place at a step end inside it (`_flush_open`). A tuple and a
# list, not a dataclass: entries run in every hook torch calls, and a slotted dataclass made
# enter + leave about 0.4 us (15%) dearer on this CPU, this form 0.05 us against a bare list.
Mark = tuple[str, list[float]]


class Budget:
    """The share of step time the guard's detectors may take (see the module docstring)."""

    def __init__(self, share: float = 0.01, *, headroom: float = 0.0, smoothing: float = SMOOTHING) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"budget share: expected 0 <= share <= 1, got {share}")
        if not 0.0 <= headroom < 1.0:
            raise ValueError(f"headroom: expected a share of the budget in 0..1 (1 excluded), got {headroom}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing: expected 0 < smoothing <= 1, got {smoothing}")
        self.share = share
        self.headroom = headroom  # the share of the budget the plans leave unspent
        self.smoothing = smoothing
        self.step_s: float | None = None  # smoothed step wall time
        self.cost_s: dict[str, float] = {}  # smoothed seconds per step, by detector
        self.spent_s: dict[str, float] = {}  # this step so far (host timers, resolved events)
        self.last_spent_s: dict[str, float] = {}  # the last step that ended
        self.last_ratio = 0.0
        self.steps = 0
        # (who, start, end) CUDA events in flight
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._ended_at: float | None = None  # host time of the last step end (step_ended)
        self._began_at: float | None = None  # host time of this step's begin (step_began)
        self._charged = 0.0  # every host charge so far (monotonic): enter/leave subtract it
        self._open: list[Mark] = []  # the entries open now, outermost first

    # --- what detectors call -----------------------------------------------------------

    def charge(self, who: str, seconds: float) -> None:
        """Add `seconds` of `who`'s work to this step."""
        seconds = max(0.0, seconds)
        self.spent_s[who] = self.spent_s.get(who, 0.0) + seconds
        self._charged += seconds

    def enter(self, who: str = "guard") -> Mark:
        """A mark at an entry point's start, for `leave`: the entry's time goes to `who`."""
        mark = (who, [time.perf_counter(), self._charged])
        if len(self._open) < MAX_OPEN:
            self._open.append(mark)
        return mark

    def entry(self, fn: Callable[..., T]) -> Callable[..., T]:
        """`fn` as an entry point torch calls: its whole host time is charged ("guard", less what
        was charged inside it), so the measured overhead is everything the guard and its plugins
        do, not only the checks. Traced (an MPU's hooks under torch.compile): no host timer."""

        def entry(*args: object, **kwargs: object) -> T:
            if compiling():
                return fn(*args, **kwargs)
            mark = self.enter("guard")
            try:
                return fn(*args, **kwargs)
            finally:
                self.leave(mark)

        return entry

    def leave(self, mark: Mark) -> None:
        """Charge the mark's `who` the host time since `enter` (or since the last step end, for
        an entry open across it), less what was charged since (nested entries and detectors'
        own charges are not counted twice)."""
        who, (t0, c0) = mark
        if self._open and self._open[-1] is mark:
            self._open.pop()
        else:  # (left out of order)
            self._open = [m for m in self._open if m is not mark]
        self.charge(who, time.perf_counter() - t0 - (self._charged - c0))

    def _flush_open(self) -> None:
        """At a step end inside entries (the optimizer hook that ends the step): their time so
        far belongs to this step; the outermost is charged and every open mark restarts now."""
        if not self._open:
            return
        who, (t0, c0) = self._open[0]
        self.charge(who, time.perf_counter() - t0 - (self._charged - c0))
        now = time.perf_counter()
        for _, times in self._open:
            times[0], times[1] = now, self._charged

    @contextlib.contextmanager
    def timer(self, who: str, device: torch.device | str | None = None) -> Iterator[None]:
        """Time the block as `who`'s work: CUDA events on a CUDA device, a host timer otherwise."""
        dev = torch.device(device) if device is not None else None
        if dev is not None and dev.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                if len(self._events) < MAX_PENDING_EVENTS:
                    self._events.append((who, start, end))
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.charge(who, time.perf_counter() - t0)

    def allowance_s(self, who: str) -> float:
        """Seconds `who` may spend in the next step: the aim (the budget less its headroom) less
        what the others spend on average. 0.0 until a step time has been measured."""
        if self.step_s is None:
            return 0.0
        others = sum(c for w, c in self.cost_s.items() if w != who)
        return max(0.0, (1.0 - self.headroom) * self.share * self.step_s - others)

    # --- what the guard calls ----------------------------------------------------------

    def end_step(self, step_s: float) -> None:
        """Close a step that took `step_s` seconds of wall time: resolve completed CUDA events,
        update the moving averages and the ratios."""
        self._flush_open()
        self._resolve()
        a = self.smoothing
        if step_s > 0:
            self.step_s = step_s if self.step_s is None else (1 - a) * self.step_s + a * step_s
        for who in set(self.cost_s) | set(self.spent_s):
            s = self.spent_s.get(who, 0.0)
            self.cost_s[who] = s if who not in self.cost_s else (1 - a) * self.cost_s[who] + a * s
        total = sum(self.spent_s.values())
        self.last_ratio = total / step_s if step_s > 0 else 0.0
        self.last_spent_s, self.spent_s = self.spent_s, {}
        self.steps += 1

    def step_began(self) -> None:
        """The guard's step begins (its first training forward): the clock of `step_ended`."""
        self._began_at = time.perf_counter()

    def step_ended(self) -> None:
        """`end_step` with the step time measured here: from `step_began` (else from the last
        call to this one; the first call without either only starts the clock)."""
        now = time.perf_counter()
        start = self._began_at if self._began_at is not None else self._ended_at
        self.end_step(now - start if start is not None else 0.0)
        self._ended_at, self._began_at = now, None

    @property
    def overhead_ratio(self) -> float:
        """The detectors' smoothed cost over the smoothed step time (0.0 before the first step)."""
        if not self.step_s:
            return 0.0
        return sum(self.cost_s.values()) / self.step_s

    def figures(self) -> dict[str, float | dict[str, float]]:
        """What the guard reports: the share, the measured ratios, the cost by detector."""
        return {
            "budget": self.share,
            "aim": (1.0 - self.headroom) * self.share,
            "overhead_ratio": self.overhead_ratio,
            "last_overhead_ratio": self.last_ratio,
            "step_s": self.step_s or 0.0,
            "cost_s": dict(self.cost_s),
        }

    def _resolve(self) -> None:
        """Charge the CUDA event pairs that have completed (query, no sync); keep the rest."""
        if not self._events:
            return
        waiting = []
        for who, start, end in self._events:
            if end.query():
                self.charge(who, start.elapsed_time(end) / 1000.0)
            else:
                waiting.append((who, start, end))
        self._events = waiting

"""Slow ranks and slow modules: each rank of a job, and each MPU on each rank, against the
same thing on the job's other ranks.

A fail-slow GPU drags every synchronous step, and the step's wall time is the same on every
rank (the fast ones wait in the gradient all-reduce), so wall time cannot point at it. What
can is the time each rank computes alone: each MPU's forward and backward time (the hook
library measures them per rank and reports them every step), and the rank's compute time,
the sum of its MPUs' forward and backward times.

The figures are the rank's `compute` and each MPU's `forward` and `backward`. For each, every
rank keeps its last `stragglers.window_steps` (20) values in a fixed ring, written as its report
comes. A step counts as compared once every live rank of the job on this node has reported it
(at least `stragglers.min_ranks`; older steps still missing a rank are then dropped), and at a
verdict the agent takes each rank's level x, the lower quartile of its window
(`stragglers.quantile`, 0.25), and the median m of the other ranks' levels:

    ratio = x / m        straggler: ratio >= stragglers.ratio (1.5)
                         and x - m >= stragglers.min_excess_s (5 ms: timing noise of small MPUs)

Held over the window: a straggler is slow in at least 3 of 4 of its last 20 steps, as a fail-slow
GPU is in every step, so one slow step (a page fault) never is one, nor are ranks that share
cores and are each preempted now and then. The median of the others, not of all: with 4 ranks
a slow rank cannot drag its own yardstick. The job's first `stragglers.warmup_steps` (5)
compared steps are left out (allocation, compilation); the verdict starts once the window is
full, is taken every `stragglers.evaluate_every_steps` (5) compared steps (the windows take
every step; a verdict waits at most that many steps more), and clears when the ratio or the
excess falls below its threshold again.

A new straggler is a finding (warning, source `stragglers`), `mpu_straggler` or `rank_straggler`
(the rank's compute), naming job, rank, local rank, MPU (id and name; empty for the rank), phase,
GPU index and UUID and node; its end a `straggler_cleared` (info). The healing policy records
them (mscale/healing/policy.yaml, rule `mpu_straggler`); an operator's policy may map a slow MPU
to an L1 swap (docs/healing.md).
Metrics: mscale.daemon.exporters.stragglers, over the immutable `StragglerView` that the watch, kept
in `state.snapshots["stragglers"]`, builds at scrape time. Across nodes Prometheus compares the
per-rank series with recording rules (mscale/rules/recording.py), since it sees every node.

Cost per report: one slot written per figure (no allocation, no sort); per step a mask of the
ranks that reported it (held by step number, so a rank whose reports come in a burst may run
`MAX_PENDING` steps ahead of the slowest and its steps are still compared); per verdict one sort of `window_steps` values per rank and figure and
one of the ranks' levels per figure, the median of the others read off the sorted levels of
all (benchmarks/straggler_overhead.py: the added cost on the agent's report path, against the
target of a tenth). Bounded: steps waiting for their last rank (`MAX_PENDING` per job), jobs
(those in state.jobs), a window per rank and figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from mscale.daemon.jobs import JobState
from mscale.daemon.keys import CONFIG, LINK, STATE
from mscale.daemon.settings import StragglerSection
from mscale.findings import Finding, Reason, Severity
from mscale.link import StepReport

SOURCE = "stragglers"
COMPUTE = "compute"  # the rank-level figure's phase: its MPUs' forward + backward
INF = math.inf
# steps per job still waiting for a rank's report, by step number: a rank whose reports come in
# bursts (its client's batch, the link's queue) may run this far ahead of the slowest one and its
# steps are still compared once that one reports them; the lowest are dropped past it
MAX_PENDING = 4096
MAX_SLOTS = 256  # ranks a job's masks tell apart; past it (ranks come and go) they start over


@dataclass(frozen=True)
class Straggler:
    """One figure of one rank, as the exporter shows it (immutable)."""

    job_id: str
    rank: int
    local_rank: int
    mpu_id: str  # "" for the rank's compute time
    mpu: str
    phase: str  # compute, forward, backward
    gpu: str  # the GPU index(es) it ran on, comma-joined
    gpu_uuid: str
    seconds: float  # the rank's quantile over the window (stragglers.quantile)
    ratio: float  # over the median of the other ranks' medians
    straggler: bool
    since_step: int | None  # the step at which the verdict was made (None: not a straggler)


@dataclass(frozen=True)
class StragglerView:
    figures: tuple[Straggler, ...] = ()
    findings_total: int = 0
    steps_compared: int = 0


class _Window:
    """A fixed ring of the figure's last `size` values: a report writes one slot, nothing is
    allocated or sorted until a verdict."""

    __slots__ = ("rank", "values", "n", "level", "ratio", "since_step")

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.values = [0.0] * size
        self.n = 0  # values written, ever; the ring is full once n >= size
        self.level = 0.0  # the window's quantile, as of the last verdict
        self.ratio = 1.0
        self.since_step: int | None = None

    def add(self, seconds: float) -> None:
        self.values[self.n % len(self.values)] = seconds
        self.n += 1

    def full(self) -> bool:
        return self.n >= len(self.values)


def median_without(levels: list[float], x: float) -> float:
    """The median of sorted `levels` with one value x (one of them) left out: the middle of
    the others is the middle of all, shifted by one on x's side. Compared by value: where x
    ties with the middle, either copy may go, the rest is the same."""
    n = len(levels) - 1
    k = n // 2
    hi = levels[k + 1] if x <= levels[k] else levels[k]
    if n % 2:
        return hi
    lo = levels[k] if x <= levels[k - 1] else levels[k - 1]
    return (lo + hi) / 2


class _Row:
    """One rank's windows: its compute, and each MPU's (forward, backward)."""

    __slots__ = ("compute", "mpus", "figures")

    def __init__(self, rank: int, size: int) -> None:
        self.compute = _Window(rank, size)
        self.mpus: dict[str, tuple[_Window, _Window]] = {}
        self.figures: list[tuple[tuple[str, str], _Window]] = [(("", COMPUTE), self.compute)]


@dataclass
class _JobBoard:
    pending: dict[int, int] = field(default_factory=dict)  # step -> the ranks that reported it, a bit per slot
    slots: dict[int, int] = field(default_factory=dict)  # rank -> its bit in pending's masks
    rows: dict[int, _Row] = field(default_factory=dict)
    windows: dict[tuple[int, str, str], _Window] = field(default_factory=dict)  # the same, for the view
    compared: int = 0

    def saw(self, rank: int, step: int) -> int:
        """Mark the step reported by the rank; the ranks that have reported it now (a mask)."""
        bit = self.slots.get(rank)
        if bit is None:
            if len(self.slots) >= MAX_SLOTS:  # ranks come and go: start the masks over
                self.slots.clear()
                self.pending.clear()
            bit = self.slots[rank] = 1 << len(self.slots)
        seen = self.pending[step] = self.pending.get(step, 0) | bit
        if len(self.pending) > MAX_PENDING:
            # the first held is the lowest step but where a rank went back (a restart): O(1)
            del self.pending[next(iter(self.pending))]
        return seen

    def whole(self, step: int) -> None:
        """The step is whole: it and the steps held before it (never whole: a rank that joined
        late or dropped a report) go."""
        self.pending.pop(step, None)
        while self.pending:
            first = next(iter(self.pending))
            if first >= step:
                break
            del self.pending[first]

    def row(self, rank: int, size: int) -> _Row:
        row = self.rows[rank] = _Row(rank, size)
        self.windows[(rank, "", COMPUTE)] = row.compute
        return row

    def mpu(self, rank: int, row: _Row, mpu_id: str, size: int) -> tuple[_Window, _Window]:
        pair = row.mpus[mpu_id] = (_Window(rank, size), _Window(rank, size))
        for phase, w in (("forward", pair[0]), ("backward", pair[1])):
            self.windows[(rank, mpu_id, phase)] = w
            row.figures.append(((mpu_id, phase), w))
        return pair


class StragglerWatch:
    """The per-job comparison; `observe` is called for every step report a rank sends."""

    def __init__(self, config: StragglerSection, state: Any) -> None:
        self.config, self.state = config, state
        self.boards: dict[str, _JobBoard] = {}
        self.findings_total = 0
        self.steps_compared = 0

    def observe(self, job: JobState, rank: int, report: StepReport) -> None:
        """O(1) per figure: the report's times go into the rank's rings; a verdict only every
        `evaluate_every_steps` whole steps."""
        cfg = self.config
        if not cfg.enabled:
            return
        step = report.step
        board = self.boards.get(job.job_id) or self.boards.setdefault(job.job_id, _JobBoard())
        if board.compared >= cfg.warmup_steps:  # the job's first steps are left out
            self._take(board, rank, report)
        seen = board.saw(rank, step)
        live = job.ranks.keys() or {rank}
        want = 0
        for r in live:
            b = board.slots.get(r)
            if b is None:
                return  # a live rank that has reported nothing yet: no step is whole
            want |= b
        if len(live) < cfg.min_ranks or seen & want != want:
            return  # (a step still missing a rank that left is dropped with the next whole one)
        board.whole(step)
        self.steps_compared += 1
        board.compared += 1
        if board.compared > cfg.warmup_steps and board.compared % cfg.evaluate_every_steps == 0:
            self._judge(job, board, step, live)

    def _take(self, board: _JobBoard, rank: int, report: StepReport) -> None:
        """The report's figures into the rank's rings (a ring per figure, made on its first
        value). Inline, no call per figure: this runs for every report of every rank."""
        size = self.config.window_steps
        row = board.rows.get(rank) or board.row(rank, size)
        compute = 0.0
        for mpu_id, m in report.mpus.items():
            pair = row.mpus.get(mpu_id)
            for phase, seconds in enumerate((m.forward_s, m.backward_s)):  # the pair's rings, in order
                if 0 < seconds < INF:  # (NaN, the job's "not measured", is not)
                    if pair is None:
                        pair = board.mpu(rank, row, mpu_id, size)
                    w = pair[phase]
                    w.values[w.n % size] = seconds
                    w.n += 1
                    compute += seconds
        if compute > 0:
            row.compute.add(compute)

    def _judge(self, job: Any, board: _JobBoard, step: int, live: Any) -> None:
        """The verdict at a whole step: each live rank's level (its window's quantile) against
        the median of the other ranks' levels, per figure. One sort per window and one per
        figure; the median without the rank is read off the sorted levels of all."""
        cfg = self.config
        q = int(cfg.quantile * (cfg.window_steps - 1))
        by_key: dict[tuple[str, str], list[_Window]] = {}
        for r in sorted(live):
            row = board.rows.get(r)
            for key, w in row.figures if row is not None else ():
                if w.n >= cfg.window_steps:
                    w.level = sorted(w.values)[q]
                    by_key.setdefault(key, []).append(w)
        for key in sorted(by_key):
            windows = by_key[key]
            if len(windows) < cfg.min_ranks:
                continue
            levels = sorted(w.level for w in windows)
            for w in windows:
                m = median_without(levels, w.level)
                w.ratio = w.level / m if m > 0 else 1.0
                slow = w.ratio >= cfg.ratio and w.level - m >= cfg.min_excess_s
                if slow and w.since_step is None:
                    w.since_step = step
                    self._finding(job, w.rank, key, w, step, True)
                elif not slow and w.since_step is not None:
                    w.since_step = None
                    self._finding(job, w.rank, key, w, step, False)

    def _where(self, job: Any, rank: int, mpu_id: str) -> dict[str, str]:
        rs = job.rank_states.get(rank)
        mpus = list(rs.mpus.values()) if rs is not None else []
        if mpu_id:
            mpus = [m for m in mpus if m.mpu_id == mpu_id]
        return {
            "local_rank": str(rs.local_rank) if rs is not None else "",
            "mpu": mpus[0].name if mpu_id and mpus else "",
            "gpu": ",".join(sorted({str(m.gpu) for m in mpus})),
            "gpu_uuid": ",".join(sorted({m.gpu_uuid for m in mpus if m.gpu_uuid})),
        }

    def _finding(self, job: Any, rank: int, key: tuple[str, str], w: _Window, step: int, found: bool) -> None:
        mpu_id, phase = key
        where = self._where(job, rank, mpu_id)
        what = f"rank {rank} of job {job.job_id}" + (f", MPU {mpu_id} ({where['mpu']})" if mpu_id else "")
        what += f" {phase} on GPU {where['gpu'] or '?'} of node {self.state.node}: "
        if found:
            what += (
                f"{w.level * 1e3:.1f} ms in {1 - self.config.quantile:.0%} of its last {len(w.values)} steps, "
                f"{w.ratio:.2f}x the median of the job's other ranks (straggler from step {step})"
            )
        else:
            what += f"back within {self.config.ratio:g}x of the other ranks at step {step}"
        labels = {"job_id": job.job_id, "rank": str(rank), "mpu_id": mpu_id, "phase": phase, **where}
        labels.update(node=self.state.node, step=str(step), ratio=f"{w.ratio:.3f}", seconds=f"{w.level:.6f}")
        if found:
            self.findings_total += 1
        reason = (Reason.MPU_STRAGGLER if mpu_id else Reason.RANK_STRAGGLER) if found else Reason.STRAGGLER_CLEARED
        severity = Severity.WARNING if found else Severity.INFO
        self.state.events.emit(Finding(SOURCE, reason, severity, what, labels))

    def forget(self) -> None:
        """Drop the boards of jobs the agent no longer holds (expired)."""
        for job_id in [j for j in self.boards if j not in self.state.jobs]:
            del self.boards[job_id]

    def view(self) -> StragglerView:
        """The comparison now, immutable (built at scrape time, in the agent's event loop)."""
        self.forget()
        out = []
        for job_id, board in sorted(self.boards.items()):
            job = self.state.jobs.get(job_id)
            if job is None:
                continue
            for (rank, mpu_id, phase), w in sorted(board.windows.items()):
                if not w.full():
                    continue
                where = self._where(job, rank, mpu_id)
                out.append(
                    Straggler(
                        job_id,
                        rank,
                        int(where["local_rank"] or 0),
                        mpu_id,
                        where["mpu"],
                        phase,
                        where["gpu"],
                        where["gpu_uuid"],
                        w.level,
                        w.ratio,
                        w.since_step is not None,
                        w.since_step,
                    )
                )
        return StragglerView(tuple(out), self.findings_total, self.steps_compared)


def setup(app: Any) -> None:
    link = app.get(LINK)
    if link is None:
        return
    watch = StragglerWatch(app[CONFIG].stragglers, app[STATE])
    link.on_report(watch.observe)
    app[STATE].publish(SOURCE, watch)  # the exporter asks it for its view

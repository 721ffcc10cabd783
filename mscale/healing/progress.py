"""Forward progress: what a fault may cost, counted per culprit, and what happens past the bound.

Every optimizer call whose update is lost is charged to the fault's culprit: an MPU (a checksum
or non-finite verdict named it) or the job (nothing did: a non-finite loss from the data, a
corrupted gradient). A lost call is a dropped update (the step skipped, or run again at the
commit point) or a step a rollback undid. The culprit climbs a ladder, `rung_calls` lost calls
a rung:

    MPU:  0 as it is, 1 at least L1, 2 at least L2, 3 at least L3, 4 the clean stop
    job:  0 as the policy says (rollback, re-run), 1 the faulty batch skipped, 2 the clean stop

One fault event (a culprit's lost calls with fewer than `clean_calls` clean calls between
them) rolls back at most once, and only when the rollback undoes at most `event_calls -
rungs x rung_calls` calls and goes to a step the culprit never rolled back to; any other
rollback is a skipped batch instead (never the same rollback twice, never a loop). So an event costs at most `event_calls` lost calls; the
run's lost calls stay within max(`event_calls`, `run_share` x calls). Past either: the clean
stop (`ProgressBoundExceeded`, with a disk snapshot and a critical finding, by the fuse).

Torch-free: the ledger only counts. With several ranks the fuse feeds it agreed values only
(the agreed failing MPUs, the agreed drops), so every rank takes the same decisions.

The fuse's keeper (`Keeper`, in the training process; torch-free too, it sees the fuse plugin,
mscale.hook.fuse.fuse, through its attributes): every lost call charged to its culprit in the
ledger, the culprit escalated past its bound, the clean stop.

    keeper = Keeper(fuse)              # the fuse makes it
    keeper.rerun(why)                  # a check failed at the commit point (the guard's request_rerun)
    keeper.rollback_fits(cost, target) # may this rollback run? (the rollback action asks)
    keeper.charge(calls, ...)          # calls lost to this step's fault
    keeper.step_end()                  # one optimizer call ended

A step whose check failed at the commit point is run again once (healing.progress_step_reruns)
on its batch from its start: weights and optimizer state as they were (the update was dropped),
data position, RNG, scheduler, scaler put back from the step mark (SnapshotEngine.rewind),
through the rollback action with the COMMIT_FAILURE reason. Past that the batch is skipped.

The culprit of a step's fault: with several ranks the first MPU (in the guard's order) the
ranks agreed failed (mscale.hook.core.agree), else the first MPU that failed in the step on this rank
(a non-finite output makes every MPU after it non-finite too), else the job. Every rank feeds
the ledger the same values, so every rank escalates, skips and stops alike; an MPU's fuse
escalation runs on the ranks where it failed (as the fuse's own counting does).

The stop: the step's update dropped, the newest in-memory snapshot written to disk (when the
snapshots have a directory), a PROGRESS_BOUND finding (critical), and `stopping` set: the guard
raises it (mscale.ProgressBoundExceeded) from the optimizer step, and from every one after.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import structlog

from mscale.findings import Finding, Reason, Severity
from mscale.healing import actions
from mscale.healing.decision import Condition, Decision
from mscale.healing.fsm import Level
from mscale.healing.target import Target
from mscale.healing.words import Result

log = structlog.get_logger("mscale.fuse")

JOB = "job"  # the culprit of a fault no MPU is named for
ROLLBACK = "rollback"  # the action (and its executor's state) a step's re-run goes through
COMMIT_FAILURE = "commit_failure"  # its reason: a check failed at the commit point
SNAPSHOT_TIMEOUT_S = 120.0  # the stop's disk snapshot: how long the stop waits for it
TARGETS_KEPT = 64  # rollback targets remembered per culprit (never the same rollback twice)
MPU_RUNGS = 4  # as it is, L1, L2, L3; then the stop
JOB_RUNGS = 2  # as the policy says, skip the batch; then the stop


class ProgressBoundExceeded(RuntimeError):
    """A fault cost more than the progress bound allows (docs/healing.md, Forward progress):
    the job stopped itself. `culprit` is the MPU id (or "job"), `step` the step it stopped at,
    `lost` the calls the event (or the run) lost, `snapshot` the disk snapshot written (or "")."""

    def __init__(self, message: str, *, culprit: str, step: int, lost: int, snapshot: str = "") -> None:
        super().__init__(message)
        self.culprit, self.step, self.lost, self.snapshot = culprit, step, lost, snapshot


@dataclass
class Culprit:
    """One culprit's current fault event."""

    key: str
    rungs: int
    lost: int = 0  # calls lost in this event (rollbacks' undone steps included)
    rung: int = 0
    rung_lost: int = 0  # faulty calls at the current rung
    clean: int = 0  # clean calls in a row since its last lost call
    rolled_back: bool = False  # this event rolled back once already
    events: int = 0

    @property
    def stopped(self) -> bool:
        return self.rung >= self.rungs


@dataclass
class Charge:
    """What one charge decided: the culprit's rung after it, whether it climbed, whether the job stops."""

    culprit: str
    rung: int
    climbed: bool
    stop: str = ""  # why the job stops ("" : it goes on)


@dataclass
class Progress:
    """The ledger (see the module docstring)."""

    rung_calls: int = 3
    event_calls: int = 24
    run_share: float = 0.25
    clean_calls: int = 5
    calls: int = 0  # optimizer calls of the run
    lost: int = 0  # lost calls of the run
    culprits: dict[str, Culprit] = field(default_factory=dict)
    # per culprit, the steps it rolled back to (kept past its events): never the same rollback twice
    targets: dict[str, deque[int]] = field(default_factory=dict)

    def culprit(self, key: str) -> Culprit:
        c = self.culprits.get(key)
        if c is None:
            c = self.culprits[key] = Culprit(key, JOB_RUNGS if key == JOB else MPU_RUNGS)
        return c

    def rollback_allowed(self, key: str, cost: int, target: int | None = None) -> bool:
        """Whether a rollback to step `target` undoing `cost` calls (the dropped one included)
        fits the culprit's event: once per event, within what the ladder leaves of
        `event_calls`, at its first rung, and never to a step the culprit rolled back to before."""
        c = self.culprit(key)
        room = self.event_calls - c.rungs * self.rung_calls - c.lost
        again = target is not None and target in self.targets.get(key, ())
        return not c.rolled_back and not again and c.rung == 0 and 0 < cost <= room

    def rolled_back(self, key: str, target: int) -> None:
        """The culprit's fault rolled back to step `target` (remembered: never again)."""
        self.targets.setdefault(key, deque(maxlen=TARGETS_KEPT)).append(target)

    def charge(self, key: str, calls: int = 1, *, faulty: bool = True, rollback: bool = False) -> Charge:
        """`calls` lost to `key`'s fault: one faulty call (`faulty`: it counts on the rung), and a
        rollback's the steps it undid too."""
        c = self.culprit(key)
        if c.lost == 0:
            c.events += 1
        c.lost += calls
        c.rung_lost += 1 if faulty else 0
        c.clean = 0
        c.rolled_back = c.rolled_back or rollback
        self.lost += calls
        climbed = False
        if faulty and c.rung_lost >= self.rung_calls:
            c.rung, c.rung_lost, climbed = c.rung + 1, 0, True
        stop = ""
        if c.stopped:
            stop = f"the fault of {_name(key)} survived every level ({c.lost} calls lost in this event)"
        elif c.lost >= self.event_calls:
            stop = f"the fault of {_name(key)} cost {c.lost} calls (bound: {self.event_calls} per fault)"
        elif self.lost > max(self.event_calls, self.run_share * self.calls):
            stop = (
                f"faults cost {self.lost} of the run's {self.calls} calls "
                f"(bound: {self.run_share:.0%} of the run, at least {self.event_calls})"
            )
        return Charge(key, c.rung, climbed, stop)

    def call(self, charged: set[str]) -> None:
        """One optimizer call ended; `charged` are the culprits charged in it. The others count
        a clean call, and an event ends after `clean_calls` of them."""
        self.calls += 1
        for key, c in list(self.culprits.items()):
            if key in charged:
                continue
            c.clean += 1
            if c.clean >= self.clean_calls:
                del self.culprits[key]

    def state(self) -> dict[str, object]:
        """The ledger's figures (events, logs, tests)."""
        return {
            "calls": self.calls,
            "lost": self.lost,
            "culprits": {k: {"lost": c.lost, "rung": c.rung, "events": c.events} for k, c in self.culprits.items()},
        }


def _name(key: str) -> str:
    return "the job" if key == JOB else f"MPU {key}"


class Keeper:
    def __init__(self, fuse: Any) -> None:
        cfg = fuse.cfg
        self.fuse = fuse
        self.ledger = Progress(
            rung_calls=cfg.progress_rung_calls,
            event_calls=cfg.progress_event_calls,
            run_share=cfg.progress_run_share,
            clean_calls=cfg.progress_clean_calls,
        )
        self.stopping: ProgressBoundExceeded | None = None
        self._charged: set[str] = set()  # culprits charged in this call
        self._step_charged = False  # this call's own loss is charged
        self._reruns: tuple[int, int] = (-1, 0)  # (step, runs failed at the commit point)
        self.reruns_skipped: list[int] = []  # steps whose re-run failed too: their batch skipped
        self.reruns_kept: list[int] = []  # steps whose re-run failed too: kept, the failing MPUs' gradients dropped

    # --- the culprit -----------------------------------------------------------------------

    def culprit(self) -> str:
        g = self.fuse.guard
        agreement = getattr(g, "agreement", None)
        last = agreement.history[-1] if agreement is not None and agreement.history else None
        if last is not None and last.step == g.current_step:
            failed = set(last.failed_mpus)
        else:
            failed = self.fuse.failed_step
        return next((m.mpu_id for m in g.mpus if m.mpu_id in failed), JOB)

    def rung(self, key: str | None = None) -> int:
        return self.ledger.culprit(key or self.culprit()).rung

    # --- charging ----------------------------------------------------------------------------

    def charge(self, calls: int = 1, *, rollback: bool = False, key: str | None = None) -> str:
        """`calls` lost to this step's fault (the step's own call once, however many actions
        charge it), its culprit escalated when it climbs, the stop when past the bound."""
        key = key or self.culprit()
        first = not self._step_charged  # this call's own loss, charged once
        extra = calls if first else calls - 1
        if not first and extra <= 0 and not rollback:
            return key
        self._step_charged = True
        self._charged.add(key)
        c = self.ledger.charge(key, max(extra, 0), faulty=first, rollback=rollback)
        if c.stop:
            self.stop(key, c.stop)
        elif c.climbed and key != JOB:
            self._escalate(key, c.rung)
        return key

    def _escalate(self, mpu_id: str, rung: int) -> None:
        """The MPU to at least fuse level `rung` (one level a climb), where it failed on this rank."""
        fuse = self.fuse
        m = fuse.guard.mpu(mpu_id)
        if mpu_id not in fuse.failed_step or Level(m.fuse_level).number >= rung:
            return
        step = fuse.guard.current_step
        labels = {"mpu_id": m.mpu_id, "mpu": m.name, "gpu": str(m.gpu), "job_id": fuse.guard.job_id}
        cond = Condition(
            kind="reason",
            name=Reason.CHECKSUM_L1_TRIGGER.value,
            labels={**labels, "progress_rung": str(rung)},
            source="fuse",
            severity="critical",
            time=fuse.clock(),
            step=step,
            occurrence=("progress", fuse.seq),
        )
        log.warning("progress_escalation", mpu_id=mpu_id, rung=rung, step=step, level=m.fuse_level)
        fuse._decide(cond)

    def step_end(self) -> None:
        self.ledger.call(self._charged)
        self._charged, self._step_charged = set(), False

    # --- the commit point's re-run --------------------------------------------------------

    def rerun(self, why: str) -> str:
        """See the module docstring: the failed run charged, the step run again from its start
        (once), else its batch skipped."""
        fuse = self.fuse
        state = fuse.states.get(ROLLBACK)
        if state is None:
            return Result.NOOP
        step = fuse.guard.current_step
        runs = self._reruns[1] + 1 if self._reruns[0] == step else 1
        self._reruns = (step, runs)
        key = self.culprit()
        again = runs > fuse.cfg.progress_step_reruns or (key == JOB and self.rung(key) >= 1)
        # the run again failed too, on an MPU, with nothing else wrong: its update is kept but
        # that MPU's gradient (as in-step verdicts keep a failed forward's): faulty, not lost
        through = again and key != JOB and fuse.may_keep_update()
        self.charge(0 if through else 1, key=key)
        if self.stopping is not None:
            return Result.FAILED
        if again:
            # every rank counts alike (it is called on every rank at every agreed fault), so every
            # rank decides together: a rollback another rule left pending is withdrawn too
            state.pending, state.handled_seq = None, fuse.seq
            if through:
                fuse.keep_update(why)
                self.reruns_kept.append(step)
                log.warning("step_kept_without_mpu_gradient", step=step, runs=runs, culprit=key, why=why)
                return Result.NOOP
            fuse.drop_step(why)
            self.reruns_skipped.append(step)
            log.warning("step_not_rerun", step=step, runs=runs, culprit=key, why=why)
            return Result.FAILED  # not re-run: the update stays dropped, the batch skipped
        if state.pending is not None:
            return Result.NOOP
        spec = actions.get(ROLLBACK)
        level = fuse._engine.job(fuse.guard.job_id).level
        d = Decision(
            rule="commit_point",
            action=spec.name,
            level=spec.level,
            target=Target(fuse.guard.job_id),
            before=level,
            reason=COMMIT_FAILURE,
            why=why,
            step=step,
            time=fuse.clock(),
        )
        return fuse.run(d)

    # --- rollbacks -----------------------------------------------------------------------------

    def rollback_fits(self, cost: int, target: int | None = None) -> bool:
        """Whether a rollback to `target` undoing `cost` calls may run for this step's fault
        (Progress.rollback_allowed); when it may, it is booked as done."""
        key = self.culprit()
        if not self.ledger.rollback_allowed(key, cost, target):
            return False
        if target is not None:
            self.ledger.rolled_back(key, target)
        return True

    # --- the stop --------------------------------------------------------------------------

    def stop(self, culprit: str, why: str) -> None:
        if self.stopping is not None:
            return
        fuse = self.fuse
        g = fuse.guard
        step = g.current_step
        fuse.drop_step(f"progress bound: {why}")
        pending = getattr(fuse.states.get(ROLLBACK), "pending", None)
        if pending is not None:
            fuse.states[ROLLBACK].pending = None
            fuse.record(pending, Result.FAILED, detail=f"not rolled back: the job stops ({why})")
        path = self._disk_snapshot(why)
        lost = self.ledger.culprits[culprit].lost if culprit in self.ledger.culprits else self.ledger.lost
        message = (
            f"step {step}: {why}; the job stops (healing.progress_event_calls "
            f"{self.ledger.event_calls}, progress_rung_calls {self.ledger.rung_calls}, progress_run_share "
            f"{self.ledger.run_share:g})" + (f"; snapshot written to {path}" if path else "; no disk snapshot")
        )
        labels = {"step": str(step), "culprit": culprit, "lost_calls": str(lost), "calls": str(self.ledger.calls)}
        if culprit != JOB:
            labels["mpu_id"] = culprit
        g.emit(Finding("fuse", Reason.PROGRESS_BOUND, Severity.CRITICAL, message, labels))
        self.stopping = ProgressBoundExceeded(message, culprit=culprit, step=step, lost=lost, snapshot=path)

    def _disk_snapshot(self, why: str) -> str:
        engine = self.fuse.snapshot_engine
        if engine is None or getattr(engine, "directory", None) is None:
            return ""
        try:
            return str(engine.emergency(why=f"progress bound: {why}").result(SNAPSHOT_TIMEOUT_S))
        except Exception as e:  # the stop goes on without it: the finding says so
            log.exception("progress_snapshot_failed", error=str(e))
            return ""

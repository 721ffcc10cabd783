"""The healing engine's books: where each MPU's fuse and each job's loss state stand, what
was done (counters for `mscale_heal_actions_total` and `mpu_drift_count_total`, the recent
decisions), the dedup ledgers, and the immutable `HealingSnapshot` published on every change.
`record` books a decision's outcome (counters, state machine, an event); `observe` keeps the
books in step with what a job reports it did itself. The deciding is the engine's
(mscale.healing.engine), which owns one HealingBooks and calls it.

The books stay bounded whatever arrives (mscale.healing.ledger): the one dedup ledger holds
the faults acted on (a duplicate for `dedup_window_s`) and the alerts acted on (their
fingerprint and start: a duplicate for ALERT_TTL_S), at most ACTED_CAP entries (oldest
evicted first, expired after the longer of the two), the occurrence ledger at most
ACTED_CAP, the recent decisions the last RECENT; each costs O(1) per condition, however long
the agent has run.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

import structlog

from mscale.findings import Finding, Reason, Severity
from mscale.healing import actions
from mscale.healing.actions.base import ActionSpec
from mscale.healing.decision import Decision
from mscale.healing.fsm import IllegalTransition, JobLossState, Level, MpuFuseState, Transition
from mscale.healing.ledger import Ledger
from mscale.healing.policy import Policy, Rule
from mscale.healing.settings import HealingSection
from mscale.healing.target import Target, gpu_label, gpu_of
from mscale.healing.words import DONE, FuseLevel, Result, TargetKind

__all__ = ["ACTED_CAP", "ALERT_TTL_S", "RANK", "RECENT", "BookHooks", "HealingBooks", "HealingSnapshot"]

log = structlog.get_logger("mscale.healing")

RANK = {  # how far up the fuse a level stands: escalations never go down
    Level.HEALTHY: 0,
    Level.SUSPECT: 1,
    Level.RECOVERED: 1,
    Level.L1_SWAPPED: 2,
    Level.L2_DEGRADED: 3,
    Level.L3_DISTILLING: 4,
}
ACTED_CAP = 32_768  # entries in the dedup ledger (faults and alerts acted on); the oldest are evicted first
ALERT_TTL_S = 86_400.0  # an alert acted on is remembered a day (Alertmanager repeats within repeat_interval)
RECENT = 50  # decisions kept for the status API


@dataclass(frozen=True)
class HealingSnapshot:
    """What the exporter and the status API read; immutable, republished on every change."""

    time: float
    actions: tuple[tuple[tuple[str, str, str, str], int], ...]  # ((level, action, mpu_id, result), n)
    drift: tuple[tuple[tuple[str, str], int], ...]  # ((job_id, mpu_id), moves)
    levels: tuple[tuple[str, str, str], ...]  # (job_id, mpu_id, state)
    cooling: tuple[str, ...]  # jobs in an LR cooling window
    recent: tuple[dict[str, Any], ...]  # last decisions, newest last


class BookHooks(TypedDict, total=False):
    """What the books are told besides policy and config (HealingBooks' keywords), as the
    engine that owns them passes them on."""

    source: str
    clock: Callable[[], float]
    emit: Callable[[Finding], Any] | None
    publish: Callable[[HealingSnapshot], Any] | None


class HealingBooks:
    """The books one HealingEngine keeps and calls (see the module docstring)."""

    def __init__(
        self,
        policy: Policy,
        cfg: HealingSection | None = None,
        *,
        source: str = "healing",
        clock: Callable[[], float] = time.time,
        emit: Callable[[Finding], Any] | None = None,
        publish: Callable[[HealingSnapshot], Any] | None = None,
    ) -> None:
        self.policy = policy
        self.cfg = cfg or HealingSection()
        self.source = source
        self.clock = clock
        self._emit = emit
        self._publish = publish
        self.mpus: dict[tuple[str, str], MpuFuseState] = {}
        self.jobs: dict[str, JobLossState] = {}
        # dedup ledgers: condition identity -> when acted (kept for the policy's window), and
        # (identity, occurrence) -> when acted (in-process: once per occurrence)
        # The one dedup ledger: a fault acted on (rule, target) is a duplicate for the policy's
        # dedup_window_s (the lookup's window), an alert acted on ("alert", fingerprint,
        # startsAt) for ALERT_TTL_S; entries expire after the longer of the two
        self.acted = Ledger(cap=ACTED_CAP, ttl_s=max(policy.dedup_window_s, ALERT_TTL_S))
        self.occurrences = Ledger(cap=ACTED_CAP)
        self.actions: Counter[tuple[str, str, str, str]] = Counter()
        self.drift: Counter[tuple[str, str]] = Counter()
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self._batching = 0  # open batch() blocks: publish once at the end of each
        self._dirty = False
        self.publish()

    # --- books ---------------------------------------------------------------------------

    def mpu(self, job_id: str, mpu_id: str) -> MpuFuseState:
        key = (job_id, mpu_id)
        if key not in self.mpus:
            self.mpus[key] = MpuFuseState(job_id, mpu_id, clean_steps=self.cfg.recovery_clean_steps)
        return self.mpus[key]

    def job(self, job_id: str) -> JobLossState:
        if job_id not in self.jobs:
            self.jobs[job_id] = JobLossState(job_id)
        return self.jobs[job_id]

    def level_of(self, rule: Rule, target: Target) -> str:
        """The target's level; a lookup keeps no books (an alert naming an MPU or job the
        engine never saw adds no state)."""
        if rule.target == TargetKind.JOB:
            job = self.jobs.get(target.job_id)
            return job.level if job is not None else JobLossState(target.job_id).level
        mpu = self.mpus.get((target.job_id, target.mpu_id))
        return mpu.level.value if mpu is not None else Level.HEALTHY.value

    def snapshot(self) -> HealingSnapshot:
        return HealingSnapshot(
            time=self.clock(),
            actions=tuple(sorted(self.actions.items())),
            drift=tuple(sorted(self.drift.items())),
            levels=tuple(sorted((j, m, f.level.value) for (j, m), f in self.mpus.items())),
            cooling=tuple(sorted(j for j, f in self.jobs.items() if f.cooling)),
            recent=tuple(self.recent),
        )

    def publish(self) -> None:
        if self._batching:
            self._dirty = True
            return
        if self._publish is not None:
            self._publish(self.snapshot())

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Book many conditions, publish once: the snapshot (sorted books) is built at the end
        of the block, not per record, so a large batch costs O(1) per record."""
        self._batching += 1
        try:
            yield
        finally:
            self._batching -= 1
            if self._dirty:
                self._dirty = False
                if self._publish is not None:
                    self._publish(self.snapshot())

    def emit(self, finding: Finding) -> None:
        if self._emit is not None:
            self._emit(finding)

    # --- recording -----------------------------------------------------------------------

    def count(self, level: str, action: str, mpu_id: str, result: str) -> None:
        self.actions[(level, action, mpu_id, result)] += 1

    def _book_job(self, spec: ActionSpec, job_id: str, result: str) -> None:
        """What an action's result means for the job's loss state (its cooling window)."""
        if spec.cools_job and result == Result.APPLIED:
            self.job(job_id).cooling = True
        elif spec.cools_job and result == Result.ENDED and job_id in self.jobs:
            self.jobs[job_id].cooling = False

    def record(
        self,
        d: Decision,
        result: str,
        *,
        detail: str = "",
        step: int | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> Finding:
        """Book a decision's outcome: counters, state machine, an event. `result` is
        applied / sent / noop / duplicate / rate_limited / disabled / failed / ended (or an
        action's own word)."""
        t = d.target
        extra = labels
        spec = actions.get(d.action)
        self.count(d.level, d.action, t.mpu_id, result)
        self._book_job(spec, t.job_id, result)
        state = ""
        if result == Result.APPLIED and t.mpu_id:  # "sent": the job reports its own move
            if spec.drift:
                self.drift[(t.job_id, t.mpu_id)] += 1
                self.mpu(t.job_id, t.mpu_id).swap_times.append(self.clock())
            if spec.moves_to is not None:
                tr = self.move(
                    t.job_id,
                    t.mpu_id,
                    spec.moves_to,
                    step=d.step if step is None else step,
                    why=f"{d.action} ({d.reason})",
                )
                state = tr.after.value if tr else self.mpu(t.job_id, t.mpu_id).level.value
        severity = {  # a result a job booked may be a word of its own
            str(Result.FAILED): Severity.CRITICAL,
            Result.APPLIED: Severity.WARNING,
            Result.SENT: Severity.WARNING,
        }.get(result, Severity.INFO)
        labels = {
            "rule": d.rule,
            "action": d.action,
            "level": d.level,
            "result": result,
            "job_id": t.job_id,
            "mpu_id": t.mpu_id,
            "gpu": gpu_label(t.gpu),
            "gpu_uuid": t.gpu_uuid,
            "reason": d.reason,
            "fault_key": d.fault_key,
        }
        if state:
            labels["state"] = state
        labels.update(extra or {})
        msg = f"{d.action} {result}: {d.why}" + (f" ({detail})" if detail else "")
        finding = Finding(
            self.source, Reason.HEAL_ACTION, severity, msg, {k: v for k, v in labels.items() if v != ""}, self.clock()
        )
        self.recent.append(dict(finding.to_dict()))
        self.emit(finding)
        self.publish()
        return finding

    def move(
        self, job_id: str, mpu_id: str, level: Level, *, step: int | None = None, why: str = ""
    ) -> Transition | None:
        """Move an MPU's fuse state; escalations never go down (an L2 MPU swapped off a dead
        GPU stays degraded). Emits a FUSE_STATE event for every transition."""
        state = self.mpu(job_id, mpu_id)
        if level is state.level:  # already there (a recovery booked twice): nothing moves, nothing to refuse
            return None
        if (
            state.level in (Level.L1_SWAPPED, Level.L2_DEGRADED, Level.L3_DISTILLING)
            and level is not Level.RECOVERED
            and RANK[level] < RANK[state.level]
        ):
            return None
        try:
            tr = state.to(level, step=-1 if step is None else step, why=why)
        except IllegalTransition as e:
            log.warning("fuse_transition_refused", job_id=job_id, mpu_id=mpu_id, error=str(e))
            return None
        self._emit_transition(job_id, mpu_id, tr)
        return tr

    def clean_step(self, job_id: str, mpu_id: str, step: int) -> Transition | None:
        tr = self.mpu(job_id, mpu_id).clean_step(step)
        if tr is not None:
            self._emit_transition(job_id, mpu_id, tr)
        return tr

    def _emit_transition(self, job_id: str, mpu_id: str, tr: Transition) -> None:
        labels = {"job_id": job_id, "mpu_id": mpu_id, "before": tr.before.value, "state": tr.after.value}
        self.emit(
            Finding(
                self.source,
                Reason.FUSE_STATE,
                Severity.WARNING if RANK[tr.after] >= 2 else Severity.INFO,
                f"mpu {mpu_id}: {tr.before.value} -> {tr.after.value}: {tr.why}",
                labels,
                self.clock(),
            )
        )
        self.publish()

    # --- mirroring a job's own actions (agent side) ----------------------------------------

    def observe(self, f: Finding) -> None:
        """A HEAL_ACTION or FUSE_STATE a job reported: keep the books in step with it so an
        alert for a fault the job already handled is a duplicate."""
        lab = f.labels
        job_id, mpu_id = lab.get("job_id", ""), lab.get("mpu_id", "")
        if f.reason is Reason.FUSE_STATE and mpu_id:
            try:
                self.mpu(job_id, mpu_id).level = Level(lab.get("state", ""))
            except ValueError:
                return
            self.publish()
            return
        if f.reason is not Reason.HEAL_ACTION:
            return
        action, result, rule = lab.get("action", ""), lab.get("result", ""), lab.get("rule", "")
        if action not in actions.REGISTRY:
            return
        spec = actions.get(action)
        self.count(lab.get("level", FuseLevel.NONE), action, mpu_id, result)
        self._book_job(spec, job_id, result)
        if result in DONE:
            try:
                kind = self.policy.rule(rule).target
            except KeyError:
                kind = TargetKind.MPU if mpu_id else TargetKind.JOB
            target = Target(job_id, mpu_id, gpu_of(lab.get("gpu")), lab.get("gpu_uuid", ""))
            self.acted.mark((rule,) + target.key(kind), self.clock())
            if spec.drift and result == Result.APPLIED:
                self.drift[(job_id, mpu_id)] += 1
            if "state" in lab and mpu_id:
                try:
                    self.mpu(job_id, mpu_id).level = Level(lab["state"])
                except ValueError:
                    pass
        self.recent.append(dict(f.to_dict()))
        self.publish()

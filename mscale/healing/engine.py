"""The healing engine: conditions in, decisions out, every decision an event.

One engine class serves both halves. In the training process the fuse plugin feeds it the
detectors' findings (with the step they were seen at) and carries the decisions out itself;
in the agent, `mscale.daemon.healing` feeds it the node's findings and alerts and sends the
decisions to jobs as commands. Both keep the same books: per-MPU fuse state machines, the
dedup ledger, counters for `mscale_heal_actions_total` and `mpu_drift_count_total`.

The policy is matched once per condition (`match`); `decide` and `resolve` take the rule so
a caller that looked at it first (the agent's service) does not match again. What the engine
does with an action (once per job or per MPU, rate limit and escalation, drift count, a job's
cooling window) comes from the action's spec (mscale.healing.actions), never its name.

Idempotence: a condition is identified by (rule, target). The same condition seen again
within the policy's `dedup_window_s` (a probe and an alert for one Xid; an alert for a fault
the job already handled and reported) is recorded as `result="duplicate"` and not acted on.
In-process conditions carry an `occurrence` instead (the fuse's step count, or a failing
stretch of an MPU at one placement): a trigger in a later occurrence is new evidence that the
last action did not cure the fault, so it escalates instead of being dropped.

The books stay bounded whatever arrives (mscale.healing.ledger): the dedup ledger keeps an
entry for `dedup_window_s` and at most ACTED_CAP entries (oldest evicted first), the
occurrence ledger at most ACTED_CAP, the recent decisions the last RECENT; each costs O(1)
per condition, however long the agent has run. A caller with an action budget passes it to
`decide_within`: the budget counts actions, not conditions.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from mscale.findings import Finding, Reason, Severity
from mscale.healing import actions
from mscale.healing.actions.base import ActionSpec
from mscale.healing.decision import Condition, Decision, Plan, Step
from mscale.healing.fsm import IllegalTransition, JobLossState, Level, MpuFuseState, Transition
from mscale.healing.ledger import Budget, Ledger
from mscale.healing.policy import Policy, Rule
from mscale.healing.settings import HealingSection
from mscale.healing.target import Target
from mscale.healing.view import NodeView
from mscale.healing.words import DONE, FuseLevel, Result, TargetKind

__all__ = [
    "ACTED_CAP",
    "ALERT_TTL_S",
    "Condition",
    "Decision",
    "HealingEngine",
    "HealingSnapshot",
    "Plan",
    "Step",
    "Target",
]

log = structlog.get_logger("mscale.healing")

_RANK = {
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


class HealingEngine:
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

    # --- deciding ------------------------------------------------------------------------

    def match(self, cond: Condition) -> Rule | None:
        """The policy rule for a condition (the first that matches), or None."""
        return self.policy.match(cond.kind, cond.name, cond.severity, cond.labels)

    def decide(
        self, cond: Condition, targets: Callable[[Rule, Condition], Iterable[Target]], rule: Rule | None = None
    ) -> list[Decision]:
        """Decisions for one condition. `targets` resolves the rule's target kind from the
        condition's labels (the agent looks at its jobs, the fuse at its own MPUs); `rule` is
        the condition's rule when the caller matched it already."""
        return self.decide_within(cond, targets, rule)[0]

    def decide_within(
        self,
        cond: Condition,
        targets: Callable[[Rule, Condition], Iterable[Target]],
        rule: Rule | None = None,
        *,
        budget: Callable[[int], int] | None = None,
        over_why: str = "action budget spent",
    ) -> tuple[list[Decision], list[Decision]]:
        """`decide` under an action budget: (decisions to carry out, decisions past the budget).
        `budget(n)` grants how many of the n decisions may run (and books them); the first that
        many run, in the policy's order, the rest are booked `rate_limited` (with `over_why`).
        A condition none of whose actions fit is not marked as acted on, so a repeat may act
        once the budget allows."""
        rule = rule or self.match(cond)
        if rule is None:
            return [], []
        now = self.clock()
        out: list[Decision] = []
        made: list[tuple[Hashable, ...]] = []  # the condition identity each decision in `out` acts on
        once: set[tuple[Hashable, ...]] = set()  # job- and GPU-scoped actions: once per job (and GPU) per condition
        acting: set[tuple[Hashable, ...]] = set()  # faults this condition acts on (every MPU on a GPU, say)
        for target in targets(rule, cond):
            ident = (rule.name,) + target.key(rule.target)
            level = self.level_of(rule, target)
            if not rule.actions_at(level):
                continue  # nothing to do at this level (e.g. already suspect): not a decision
            if ident not in acting and self._duplicate(ident, cond, now):
                if cond.occurrence is None:  # in-process: the occurrence's action has its event already
                    self._record_duplicate(rule, target, level, cond, now)
                continue
            acting.add(ident)
            for name in rule.actions_at(level):
                spec, why = self._rate_limited(actions.get(name), target, now)
                if spec.scope != TargetKind.MPU:
                    key = (spec.name, target.job_id) + (
                        (target.gpu_uuid or target.gpu,) if spec.scope == TargetKind.GPU else ()
                    )
                    if key in once:
                        continue
                    once.add(key)
                out.append(
                    Decision(
                        rule.name,
                        spec.name,
                        spec.level,
                        target,
                        level,
                        cond.name,
                        why or f"{cond.name} at {level}",
                        cond.step,
                        now,
                    )
                )
                made.append(ident)
        if not self.cfg.enabled and out:
            self._mark(acting, cond, now)
            for d in out:
                self.record(d, Result.DISABLED)
            return [], []
        over: list[Decision] = []
        if budget is not None and out:
            fit = max(0, min(len(out), budget(len(out))))
            out, over = out[:fit], out[fit:]
            # a fault none of whose actions ran is not acted on: a repeat may act later
            acting -= set(made[fit:]) - set(made[:fit])
            for d in over:
                self.record(d, Result.RATE_LIMITED, detail=over_why)
            if not out:
                return [], over
        self._mark(acting, cond, now)
        return out, over

    def plan(
        self,
        cond: Condition,
        view: NodeView,
        *,
        alert: tuple[str, str] | None = None,
        resolved: bool = False,
        budget: Budget | None = None,
    ) -> Plan:
        """The plan for one condition the agent saw, from the node's view: the one way from a
        finding or an alert to its actions. `alert` is an Alertmanager alert's identity
        (fingerprint, startsAt), kept in the dedup ledger: its repeat is a duplicate, its
        resolution (`resolved`) ends what its firing started. `budget` counts the actions an
        alert may take per minute. Rate-limited, duplicate and disabled decisions are booked
        here; the plan's steps are booked by `book` once carried out."""
        rule = self.match(cond)
        now = self.clock()
        key = None if alert is None else ("alert", *alert)

        def targets(r: Rule, c: Condition) -> list[Target]:
            return view.targets(r.target, c.labels)

        if resolved:
            acted_on = key is not None and self.acted.pop(key) is not None  # its firing acted here
            ends = self.resolve(cond, targets, rule) if rule is not None else []
            # it ends only what its own firing started: a resolution never seen firing ends nothing
            return Plan("resolved", ends=tuple(Step(d, d.command(end=True)) for d in ends if acted_on))
        if key is not None and self.acted.fresh(key, now):  # Alertmanager's repeat of an alert acted on
            self.refuse(rule, cond, Result.DUPLICATE, "Alertmanager repeated an alert already acted on")
            return Plan(Result.DUPLICATE)
        if key is None and (rule is None or rule.decide == "in_process"):
            return Plan("none")  # nothing to do, or the job acts within the step and reports what it did
        run: list[Decision] = []
        over: list[Decision] = []
        if rule is not None:
            take = None if budget is None else (lambda n: budget.take(n, now))
            why = "action budget spent" if budget is None else f"action budget of {budget.per_minute}/min spent"
            run, over = self.decide_within(cond, targets, rule, budget=take, over_why=why)
        if over and not run:
            return Plan(Result.RATE_LIMITED, rate_limited=len(over))
        if key is not None:
            self.acted.mark(key, now)
        steps = tuple(Step(d, d.command(), view.ranks(d.target)) for d in run)
        return Plan("acted", steps, rate_limited=len(over))

    def book(self, outcomes: Iterable[tuple[Step, str, str]]) -> None:
        """Book a carried-out plan's outcomes, (step, result, detail) each, in one call."""
        with self.batch():
            for step, result, detail in outcomes:
                self.record(step.decision, result, detail=detail)

    def _mark(self, acting: set[tuple[Hashable, ...]], cond: Condition, now: float) -> None:
        for ident in sorted(acting, key=repr):  # a set's order is not the ledger's to keep
            if cond.occurrence is not None:
                self.occurrences.mark(ident + (cond.occurrence,), now)
            self.acted.mark(ident, now)

    def _duplicate(self, ident: tuple[Hashable, ...], cond: Condition, now: float) -> bool:
        if cond.occurrence is not None:
            # in-process: once per occurrence; a later one is new evidence
            return ident + (cond.occurrence,) in self.occurrences
        return self.acted.fresh(ident, now, self.policy.dedup_window_s)

    def _rate_limited(self, spec: ActionSpec, target: Target, now: float) -> tuple[ActionSpec, str]:
        """A drift past healing.max_swaps_per_hour: the escalation instead, past the level the
        MPU already holds (an MPU at L2 goes to L3)."""
        if not spec.drift or not target.mpu_id:
            return spec, ""
        state = self.mpus.get((target.job_id, target.mpu_id))
        if state is None or state.swaps_since(now - 3600.0) < self.cfg.max_swaps_per_hour:
            return spec, ""
        self._count(spec.level, spec.name, target.mpu_id, Result.RATE_LIMITED)
        why = f"{self.cfg.max_swaps_per_hour} swaps in the last hour: escalate"
        nxt = spec
        while nxt.escalates_to and (
            nxt is spec or (nxt.moves_to is not None and _RANK[nxt.moves_to] <= _RANK[state.level])
        ):
            nxt = actions.get(nxt.escalates_to)
        return nxt, why

    def _record_duplicate(self, rule: Rule, target: Target, level: str, cond: Condition, now: float) -> None:
        spec = actions.get(rule.actions_at(level)[0])
        d = Decision(
            rule.name,
            spec.name,
            spec.level,
            target,
            level,
            cond.name,
            f"same fault within {self.policy.dedup_window_s:g}s",
            cond.step,
            now,
        )
        self.record(d, Result.DUPLICATE)

    def refuse(self, rule: Rule | None, cond: Condition, result: str, why: str) -> None:
        """Book a condition not acted on (a repeated or rate-limited alert): an event and a
        count under the rule's first action, targeted from the condition's labels."""
        if rule is None:
            return
        first = next((a for acts in rule.actions.values() for a in acts), "")
        if not first:
            return
        lab = cond.labels
        target = Target(lab.get("job_id", ""), lab.get("mpu_id", ""), lab.get("gpu", ""), lab.get("gpu_uuid", ""))
        self.record(
            Decision(rule.name, first, actions.get(first).level, target, "", cond.name, why, time=cond.time), result
        )

    def resolve(
        self, cond: Condition, targets: Callable[[Rule, Condition], Iterable[Target]], rule: Rule | None = None
    ) -> list[Decision]:
        """A resolved alert: forget its dedup entry (a re-fire acts again). Returns the end
        decisions for what its rule started and is still in force (the jobs' cooling windows),
        to be sent as end commands."""
        rule = rule or self.match(cond)
        if rule is None:
            return []
        cooling = [actions.get(a) for a in dict.fromkeys(a for acts in rule.actions.values() for a in acts)]
        cooling = [s for s in cooling if s.cools_job]
        out = []
        for target in targets(rule, cond):
            self.acted.pop((rule.name,) + target.key(rule.target))
            if target.job_id and self.job(target.job_id).cooling:
                out += [
                    Decision(
                        rule.name,
                        s.name,
                        s.level,
                        target,
                        "cooling",
                        cond.name,
                        f"alert {cond.name} resolved",
                        time=self.clock(),
                    )
                    for s in cooling
                ]
        return out

    # --- recording -----------------------------------------------------------------------

    def _count(self, level: str, action: str, mpu_id: str, result: str) -> None:
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
        self._count(d.level, d.action, t.mpu_id, result)
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
            "gpu": t.gpu,
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
            and _RANK[level] < _RANK[state.level]
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
                Severity.WARNING if _RANK[tr.after] >= 2 else Severity.INFO,
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
        self._count(lab.get("level", FuseLevel.NONE), action, mpu_id, result)
        self._book_job(spec, job_id, result)
        if result in DONE:
            try:
                kind = self.policy.rule(rule).target
            except KeyError:
                kind = TargetKind.MPU if mpu_id else TargetKind.JOB
            target = Target(job_id, mpu_id, lab.get("gpu", ""), lab.get("gpu_uuid", ""))
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

"""The healing engine: conditions in, decisions out, every decision an event.

One engine class serves both halves. In the training process the fuse plugin feeds it the
detectors' findings (with the step they were seen at) and carries the decisions out itself;
in the agent, `mscale.daemon.healing` feeds it the node's findings and alerts and sends the
decisions to jobs as commands. Both keep the same books: per-MPU fuse state machines, the
dedup ledger, counters for `mscale_heal_actions_total` and `mpu_drift_count_total`.

In the agent there is one way through: `plan(cond, view)` takes the condition and the node's
view (mscale.healing.view) and returns the plan (mscale.healing.decision.Plan: each decision
with its command and the ranks it goes to), which the agent carries out and books in one call
(`book`); the engine never calls the agent back. The fuse uses `decide` with its own targets.
The policy is matched once per condition (`match`); `decide` and `resolve` take the rule so
a caller that looked at it first does not match again. What the engine
does with an action (once per job or per MPU, rate limit and escalation, drift count, a job's
cooling window) comes from the action's spec (mscale.healing.actions), never its name.

Idempotence: a condition is identified by (rule, target). The same condition seen again
within the policy's `dedup_window_s` (a probe and an alert for one Xid; an alert for a fault
the job already handled and reported) is recorded as `result="duplicate"` and not acted on.
In-process conditions carry an `occurrence` instead (the fuse's step count, or a failing
stretch of an MPU at one placement): a trigger in a later occurrence is new evidence that the
last action did not cure the fault, so it escalates instead of being dropped.

The books (fuse states, counters, ledgers, the published snapshot, `record`, `observe`) are a
part the engine owns (`books`, mscale.healing.books.HealingBooks) and calls; they stay bounded
whatever arrives. The engine hands the callers that book outcomes (the fuse, the agent's
service) the books' own calls (`record`, `observe`, `mpu`, `job`, ...), each one line here. A
caller with an action budget passes it to `decide_within`: the budget counts actions, not
conditions.
"""

from __future__ import annotations

import contextlib
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any, Unpack

from mscale.findings import Finding
from mscale.healing import actions
from mscale.healing.actions.base import ActionSpec
from mscale.healing.books import ACTED_CAP, ALERT_TTL_S, RANK, BookHooks, HealingBooks, HealingSnapshot
from mscale.healing.decision import Condition, Decision, Plan, Step
from mscale.healing.fsm import JobLossState, Level, MpuFuseState, Transition
from mscale.healing.ledger import Budget, Ledger
from mscale.healing.policy import Policy, Rule
from mscale.healing.settings import HealingSection
from mscale.healing.target import Target, gpu_of
from mscale.healing.view import NodeView
from mscale.healing.words import Result, TargetKind

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


class HealingEngine:
    """Conditions in, decisions out (see the module docstring); it owns its books."""

    def __init__(self, policy: Policy, cfg: HealingSection | None = None, **hooks: Unpack[BookHooks]) -> None:
        self.books = HealingBooks(policy, cfg, **hooks)
        self.policy, self.cfg, self.clock = policy, self.books.cfg, self.books.clock

    # --- the books, as the callers that book outcomes reach them ------------------------------

    def record(
        self,
        d: Decision,
        result: str,
        *,
        detail: str = "",
        step: int | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> Finding:
        """Book a decision's outcome (HealingBooks.record)."""
        return self.books.record(d, result, detail=detail, step=step, labels=labels)

    def observe(self, f: Finding) -> None:
        """A job's own HEAL_ACTION or FUSE_STATE into the books (HealingBooks.observe)."""
        self.books.observe(f)

    def mpu(self, job_id: str, mpu_id: str) -> MpuFuseState:
        return self.books.mpu(job_id, mpu_id)

    def job(self, job_id: str) -> JobLossState:
        return self.books.job(job_id)

    def move(
        self, job_id: str, mpu_id: str, level: Level, *, step: int | None = None, why: str = ""
    ) -> Transition | None:
        return self.books.move(job_id, mpu_id, level, step=step, why=why)

    def clean_step(self, job_id: str, mpu_id: str, step: int) -> Transition | None:
        return self.books.clean_step(job_id, mpu_id, step)

    def snapshot(self) -> HealingSnapshot:
        return self.books.snapshot()

    def publish(self) -> None:
        self.books.publish()

    def emit(self, finding: Finding) -> None:
        self.books.emit(finding)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Book many conditions, publish once (HealingBooks.batch)."""
        with self.books.batch():
            yield

    @property
    def acted(self) -> Ledger:
        """The dedup ledger: faults and alerts acted on."""
        return self.books.acted

    @property
    def mpus(self) -> dict[tuple[str, str], MpuFuseState]:
        return self.books.mpus

    @property
    def jobs(self) -> dict[str, JobLossState]:
        return self.books.jobs

    @property
    def actions(self) -> Counter[tuple[str, str, str, str]]:
        return self.books.actions

    @property
    def drift(self) -> Counter[tuple[str, str]]:
        return self.books.drift

    @property
    def recent(self) -> deque[dict[str, Any]]:
        return self.books.recent

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
        out, made, acting = self._decisions(rule, cond, now, targets(rule, cond))
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

    def _decisions(
        self, rule: Rule, cond: Condition, now: float, targets: Iterable[Target]
    ) -> tuple[list[Decision], list[tuple[Hashable, ...]], set[tuple[Hashable, ...]]]:
        """The decisions for each target at its level, in the policy's order: (decisions, the
        fault each acts on, the faults acted on). A fault acted on within the window is a
        duplicate (booked, for a condition from outside the step); a job- or GPU-scoped action
        is decided once per job (and GPU) however many of its MPUs the condition names."""
        out: list[Decision] = []
        made: list[tuple[Hashable, ...]] = []  # the condition identity each decision in `out` acts on
        once: set[tuple[Hashable, ...]] = set()  # job- and GPU-scoped actions: once per job (and GPU) per condition
        acting: set[tuple[Hashable, ...]] = set()  # faults this condition acts on (every MPU on a GPU, say)
        for target in targets:
            ident = (rule.name,) + target.key(rule.target)
            level = self.books.level_of(rule, target)
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
                    key = (spec.name, target.job_id) + ((target.gpu_key,) if spec.scope == TargetKind.GPU else ())
                    if key in once:
                        continue
                    once.add(key)
                reason = why or f"{cond.name} at {level}"
                out.append(
                    Decision(
                        rule=rule.name,
                        action=spec.name,
                        level=spec.level,
                        target=target,
                        before=level,
                        reason=cond.name,
                        why=reason,
                        step=cond.step,
                        time=now,
                    )
                )
                made.append(ident)
        return out, made, acting

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
            acted_on = key is not None and self.books.acted.pop(key) is not None  # its firing acted here
            ends = self.resolve(cond, targets, rule) if rule is not None else []
            # it ends only what its own firing started: a resolution never seen firing ends nothing
            return Plan("resolved", ends=tuple(Step(d, d.command(end=True)) for d in ends if acted_on))
        if key is not None and self.books.acted.fresh(key, now):  # Alertmanager's repeat of an alert acted on
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
            self.books.acted.mark(key, now)
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
                self.books.occurrences.mark(ident + (cond.occurrence,), now)
            self.books.acted.mark(ident, now)

    def _duplicate(self, ident: tuple[Hashable, ...], cond: Condition, now: float) -> bool:
        if cond.occurrence is not None:
            # in-process: once per occurrence; a later one is new evidence
            return ident + (cond.occurrence,) in self.books.occurrences
        return self.books.acted.fresh(ident, now, self.policy.dedup_window_s)

    def _rate_limited(self, spec: ActionSpec, target: Target, now: float) -> tuple[ActionSpec, str]:
        """A drift past healing.max_swaps_per_hour: the escalation instead, past the level the
        MPU already holds (an MPU at L2 goes to L3)."""
        if not spec.drift or not target.mpu_id:
            return spec, ""
        state = self.books.mpus.get((target.job_id, target.mpu_id))
        if state is None or state.swaps_since(now - 3600.0) < self.cfg.max_swaps_per_hour:
            return spec, ""
        self.books.count(spec.level, spec.name, target.mpu_id, Result.RATE_LIMITED)
        why = f"{self.cfg.max_swaps_per_hour} swaps in the last hour: escalate"
        nxt = spec
        while nxt.escalates_to and (
            nxt is spec or (nxt.moves_to is not None and RANK[nxt.moves_to] <= RANK[state.level])
        ):
            nxt = actions.get(nxt.escalates_to)
        return nxt, why

    def _record_duplicate(self, rule: Rule, target: Target, level: str, cond: Condition, now: float) -> None:
        spec = actions.get(rule.actions_at(level)[0])
        d = Decision(
            rule=rule.name,
            action=spec.name,
            level=spec.level,
            target=target,
            before=level,
            reason=cond.name,
            why=f"same fault within {self.policy.dedup_window_s:g}s",
            step=cond.step,
            time=now,
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
        target = Target(
            job_id=lab.get("job_id", ""),
            mpu_id=lab.get("mpu_id", ""),
            gpu=gpu_of(lab.get("gpu")),
            gpu_uuid=lab.get("gpu_uuid", ""),
        )
        d = Decision(
            rule=rule.name,
            action=first,
            level=actions.get(first).level,
            target=target,
            before="",
            reason=cond.name,
            why=why,
            time=cond.time,
        )
        self.record(d, result)

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
            self.books.acted.pop((rule.name,) + target.key(rule.target))
            if target.job_id and self.books.job(target.job_id).cooling:
                out += [
                    Decision(
                        rule=rule.name,
                        action=s.name,
                        level=s.level,
                        target=target,
                        before="cooling",
                        reason=cond.name,
                        why=f"alert {cond.name} resolved",
                        time=self.clock(),
                    )
                    for s in cooling
                ]
        return out

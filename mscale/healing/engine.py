"""The healing engine: conditions in, decisions out, every decision an event.

One engine class serves both halves. In the training process the fuse plugin feeds it the
detectors' findings (with the step they were seen at) and carries the decisions out itself;
in the agent, `mscale.daemon.healing` feeds it the node's findings and alerts and sends the
decisions to jobs as commands. Both keep the same books: per-MPU fuse state machines, the
dedup ledger, counters for `mscale_heal_actions_total` and `mpu_drift_count_total`.

Idempotence: a condition is identified by (rule, target). The same condition seen again
within the policy's `dedup_window_s` (a probe and an alert for one Xid; an alert for a fault
the job already handled and reported) is recorded as `result="duplicate"` and not acted on.
In-process conditions carry their step: a trigger at a later step is new evidence that the
last action did not cure the fault, so it escalates instead of being dropped.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import structlog

from mscale.findings import Finding, Reason, Severity
from mscale.healing import actions
from mscale.healing.fsm import IllegalTransition, JobFuse, Level, MpuFuse, Transition
from mscale.healing.policy import Policy, Rule
from mscale.healing.settings import HealingSection

log = structlog.get_logger("mscale.healing")

_RANK = {Level.HEALTHY: 0, Level.SUSPECT: 1, Level.RECOVERED: 1, Level.L1_SWAPPED: 2,
         Level.L2_DEGRADED: 3, Level.L3_DISTILLING: 4}
# results that mean the action took effect (the state machine moves on)
DONE = ("applied", "sent")


@dataclass(frozen=True)
class Condition:
    kind: str  # "reason" (a Finding's reason code) or "alert" (an Alertmanager alert name)
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    source: str = ""
    severity: str = ""
    time: float = 0.0
    step: int | None = None  # in-process: the step it was seen at

    @classmethod
    def of(cls, f: Finding, step: int | None = None) -> "Condition":
        return cls("reason", f.reason.value, dict(f.labels), f.source, f.severity.value, f.time, step)


@dataclass(frozen=True)
class Target:
    job_id: str = ""
    mpu_id: str = ""
    gpu: str = ""  # GPU index as text ("" when unknown)
    gpu_uuid: str = ""

    def key(self, kind: str) -> tuple:
        if kind == "gpu":
            return ("gpu", self.gpu_uuid or self.gpu)
        if kind == "job":
            return ("job", self.job_id)
        return ("mpu", self.job_id, self.mpu_id)


@dataclass(frozen=True)
class Decision:
    rule: str
    action: str
    level: str  # L1, L2, L3 or none
    target: Target
    before: str  # the target's level when decided
    reason: str  # the condition (reason code or alert name)
    why: str = ""
    step: int | None = None
    time: float = 0.0

    @property
    def fault_key(self) -> str:
        t = self.target
        return "/".join((self.rule, t.job_id, t.mpu_id, t.gpu_uuid or t.gpu))

    def command(self) -> dict:
        """The link command carrying this decision to a job."""
        t = self.target
        return {"type": "heal", "action": self.action, "rule": self.rule, "level": self.level,
                "mpu_id": t.mpu_id, "gpu": t.gpu, "gpu_uuid": t.gpu_uuid, "reason": self.reason,
                "why": self.why, "fault_key": self.fault_key, "decided_at": self.time}

    @classmethod
    def from_command(cls, cmd: Mapping[str, Any], job_id: str) -> "Decision":
        action = str(cmd.get("action", ""))
        spec = actions.get(action)  # KeyError names the known actions
        return cls(rule=str(cmd.get("rule", "command")), action=action, level=spec.level,
                   target=Target(job_id, str(cmd.get("mpu_id", "")), str(cmd.get("gpu", "")),
                                 str(cmd.get("gpu_uuid", ""))),
                   before="", reason=str(cmd.get("reason", "command")), why=str(cmd.get("why", "")),
                   time=float(cmd.get("decided_at", 0.0) or 0.0))


@dataclass(frozen=True)
class HealingSnapshot:
    """What the exporter and the status API read; immutable, republished on every change."""

    time: float
    actions: tuple[tuple[tuple[str, str, str, str], int], ...]  # ((level, action, mpu_id, result), n)
    drift: tuple[tuple[tuple[str, str], int], ...]  # ((job_id, mpu_id), moves)
    levels: tuple[tuple[str, str, str], ...]  # (job_id, mpu_id, state)
    cooling: tuple[str, ...]  # jobs in an LR cooling window
    recent: tuple[dict, ...]  # last decisions, newest last


class HealingEngine:
    def __init__(self, policy: Policy, cfg: HealingSection | None = None, *, source: str = "healing",
                 clock: Callable[[], float] = time.time, emit: Callable[[Finding], Any] | None = None,
                 publish: Callable[[HealingSnapshot], Any] | None = None) -> None:
        self.policy = policy
        self.cfg = cfg or HealingSection()
        self.source = source
        self.clock = clock
        self._emit = emit
        self._publish = publish
        self.fuses: dict[tuple[str, str], MpuFuse] = {}
        self.jobs: dict[str, JobFuse] = {}
        self.acted: dict[tuple, float] = {}  # dedup ledger: condition identity -> when acted
        self.actions: Counter[tuple[str, str, str, str]] = Counter()
        self.drift: Counter[tuple[str, str]] = Counter()
        self.recent: deque[dict] = deque(maxlen=50)
        self.publish()

    # --- books ---------------------------------------------------------------------------

    def fuse(self, job_id: str, mpu_id: str) -> MpuFuse:
        key = (job_id, mpu_id)
        if key not in self.fuses:
            self.fuses[key] = MpuFuse(job_id, mpu_id, clean_steps=self.cfg.recovery_clean_steps)
        return self.fuses[key]

    def job(self, job_id: str) -> JobFuse:
        if job_id not in self.jobs:
            self.jobs[job_id] = JobFuse(job_id)
        return self.jobs[job_id]

    def level_of(self, rule: Rule, target: Target, step: int | None) -> str:
        if rule.target == "job":
            j = self.job(target.job_id)
            if step is None:
                return "cooling" if j.cooling_until >= 0 else "healthy"
            return "cooling" if j.cooling(step) else "healthy"
        return self.fuse(target.job_id, target.mpu_id).level.value

    def snapshot(self) -> HealingSnapshot:
        return HealingSnapshot(
            time=self.clock(),
            actions=tuple(sorted(self.actions.items())),
            drift=tuple(sorted(self.drift.items())),
            levels=tuple(sorted((j, m, f.level.value) for (j, m), f in self.fuses.items())),
            cooling=tuple(sorted(j for j, f in self.jobs.items() if f.cooling_until >= 0)),
            recent=tuple(self.recent))

    def publish(self) -> None:
        if self._publish is not None:
            self._publish(self.snapshot())

    def emit(self, finding: Finding) -> None:
        if self._emit is not None:
            self._emit(finding)

    # --- deciding ------------------------------------------------------------------------

    def decide(self, cond: Condition, targets: Callable[[Rule, Condition], Iterable[Target]]) -> list[Decision]:
        """Decisions for one condition. `targets` resolves the rule's target kind from the
        condition's labels (the agent looks at its jobs, the fuse at its own MPUs)."""
        rule = self.policy.match(cond.kind, cond.name, cond.severity, cond.labels)
        if rule is None:
            return []
        now = self.clock()
        out: list[Decision] = []
        job_scoped: set[tuple[str, str]] = set()  # a job-wide action once per job per condition
        for target in targets(rule, cond):
            ident = (rule.name,) + target.key(rule.target)
            level = self.level_of(rule, target, cond.step)
            if not rule.actions_at(level):
                continue  # nothing to do at this level (e.g. already suspect): not a decision
            if self._duplicate(ident, cond, now):
                self._record_duplicate(rule, target, level, cond, now)
                continue
            self.acted[ident + ((cond.step,) if cond.step is not None else ())] = now
            self.acted[ident] = now
            for name in rule.actions_at(level):
                name, why = self._rate_limited(name, target, now)
                spec = actions.get(name)
                if spec.moves_to is None and name != "l1_swap":
                    if (name, target.job_id) in job_scoped:
                        continue
                    job_scoped.add((name, target.job_id))
                out.append(Decision(rule.name, name, spec.level, target, level, cond.name,
                                    why or f"{cond.name} at {level}", cond.step, now))
        if not self.cfg.enabled and out:
            for d in out:
                self.record(d, "disabled")
            return []
        return out

    def _duplicate(self, ident: tuple, cond: Condition, now: float) -> bool:
        window = self.policy.dedup_window_s
        if cond.step is not None:
            # in-process: once per step; a later step is new evidence
            return ident + (cond.step,) in self.acted
        last = self.acted.get(ident)
        return last is not None and now - last < window

    def _rate_limited(self, name: str, target: Target, now: float) -> tuple[str, str]:
        if name != "l1_swap" or not target.mpu_id:
            return name, ""
        fuse = self.fuse(target.job_id, target.mpu_id)
        if fuse.swaps_since(now - 3600.0) >= self.cfg.max_swaps_per_hour:
            self._count("L1", "l1_swap", target.mpu_id, "rate_limited")
            why = f"{self.cfg.max_swaps_per_hour} swaps in the last hour: escalate"
            if fuse.level in (Level.L2_DEGRADED, Level.L3_DISTILLING):
                return "l3_distill", why
            return "l2_degrade", why
        return name, ""

    def _record_duplicate(self, rule: Rule, target: Target, level: str, cond: Condition, now: float) -> None:
        acts = rule.actions_at(level) or ("none",)
        d = Decision(rule.name, acts[0], actions.get(acts[0]).level if acts[0] != "none" else "none",
                     target, level, cond.name, f"same fault within {self.policy.dedup_window_s:g}s", cond.step, now)
        self.record(d, "duplicate")

    def resolve(self, cond: Condition, targets: Callable[[Rule, Condition], Iterable[Target]]) -> list[Target]:
        """A resolved alert: forget its dedup entry (a re-fire acts again) and end the
        cooling windows of the jobs it names. Returns the jobs whose cooling ended."""
        rule = self.policy.match(cond.kind, cond.name, cond.severity, cond.labels)
        if rule is None:
            return []
        ended = []
        for target in targets(rule, cond):
            self.acted.pop((rule.name,) + target.key(rule.target), None)
            if rule.target == "job" and self.job(target.job_id).cooling_until >= 0:
                ended.append(target)
        return ended

    # --- recording -----------------------------------------------------------------------

    def _count(self, level: str, action: str, mpu_id: str, result: str) -> None:
        self.actions[(level, action, mpu_id, result)] += 1

    def record(self, d: Decision, result: str, *, detail: str = "", step: int | None = None,
               labels: Mapping[str, str] | None = None) -> Finding:
        """Book a decision's outcome: counters, state machine, an event. `result` is
        applied / sent / noop / duplicate / rate_limited / disabled / failed."""
        t = d.target
        extra = labels
        self._count(d.level, d.action, t.mpu_id, result)
        state = ""
        if result in DONE and d.action != "none":
            spec = actions.get(d.action)
            if d.action == "l1_swap" and result == "applied":
                self.drift[(t.job_id, t.mpu_id)] += 1
                self.fuse(t.job_id, t.mpu_id).swap_times.append(self.clock())
            if spec.moves_to is not None and t.mpu_id and result == "applied":  # "sent": the job reports its move
                tr = self.move(t.job_id, t.mpu_id, spec.moves_to, step=d.step if step is None else step,
                               why=f"{d.action} ({d.reason})")
                state = (tr.after.value if tr else self.fuse(t.job_id, t.mpu_id).level.value)
        severity = {"failed": Severity.CRITICAL, "applied": Severity.WARNING,
                    "sent": Severity.WARNING}.get(result, Severity.INFO)
        labels = {"rule": d.rule, "action": d.action, "level": d.level, "result": result,
                  "job_id": t.job_id, "mpu_id": t.mpu_id, "gpu": t.gpu, "gpu_uuid": t.gpu_uuid,
                  "reason": d.reason, "fault_key": d.fault_key}
        if state:
            labels["state"] = state
        labels.update(extra or {})
        msg = f"{d.action} {result}: {d.why}" + (f" ({detail})" if detail else "")
        finding = Finding(self.source, Reason.HEAL_ACTION, severity, msg,
                          {k: v for k, v in labels.items() if v != ""}, self.clock())
        self.recent.append(dict(finding.to_dict()))
        self.emit(finding)
        self.publish()
        return finding

    def move(self, job_id: str, mpu_id: str, level: Level, *, step: int | None = None, why: str = "") -> Transition | None:
        """Move an MPU's fuse; escalations never go down (an L2 MPU swapped off a dead GPU
        stays degraded). Emits a FUSE_STATE event for every transition."""
        fuse = self.fuse(job_id, mpu_id)
        if fuse.level in (Level.L1_SWAPPED, Level.L2_DEGRADED, Level.L3_DISTILLING) \
                and level is not Level.RECOVERED and _RANK[level] < _RANK[fuse.level]:
            return None
        try:
            tr = fuse.to(level, step=-1 if step is None else step, why=why)
        except IllegalTransition as e:
            log.warning("fuse_transition_refused", job_id=job_id, mpu_id=mpu_id, error=str(e))
            return None
        self._emit_transition(job_id, mpu_id, tr)
        return tr

    def clean_step(self, job_id: str, mpu_id: str, step: int) -> Transition | None:
        tr = self.fuse(job_id, mpu_id).clean_step(step)
        if tr is not None:
            self._emit_transition(job_id, mpu_id, tr)
        return tr

    def _emit_transition(self, job_id: str, mpu_id: str, tr: Transition) -> None:
        labels = {"job_id": job_id, "mpu_id": mpu_id, "before": tr.before.value, "state": tr.after.value}
        self.emit(Finding(self.source, Reason.FUSE_STATE,
                          Severity.WARNING if _RANK[tr.after] >= 2 else Severity.INFO,
                          f"mpu {mpu_id}: {tr.before.value} -> {tr.after.value}: {tr.why}", labels, self.clock()))
        self.publish()

    # --- mirroring a job's own actions (agent side) ----------------------------------------

    def observe(self, f: Finding) -> None:
        """A HEAL_ACTION or FUSE_STATE a job reported: keep the books in step with it so an
        alert for a fault the job already handled is a duplicate."""
        lab = f.labels
        job_id, mpu_id = lab.get("job_id", ""), lab.get("mpu_id", "")
        if f.reason is Reason.FUSE_STATE and mpu_id:
            try:
                self.fuse(job_id, mpu_id).level = Level(lab.get("state", ""))
            except ValueError:
                return
            self.publish()
            return
        if f.reason is not Reason.HEAL_ACTION:
            return
        action, result, rule = lab.get("action", ""), lab.get("result", ""), lab.get("rule", "")
        if action not in actions.REGISTRY:
            return
        self._count(lab.get("level", "none"), action, mpu_id, result)
        if result in DONE:
            try:
                kind = self.policy.rule(rule).target
            except KeyError:
                kind = "mpu" if mpu_id else "job"
            target = Target(job_id, mpu_id, lab.get("gpu", ""), lab.get("gpu_uuid", ""))
            self.acted[(rule,) + target.key(kind)] = self.clock()
            if action == "l1_swap" and result == "applied":
                self.drift[(job_id, mpu_id)] += 1
            if "state" in lab and mpu_id:
                try:
                    self.fuse(job_id, mpu_id).level = Level(lab["state"])
                except ValueError:
                    pass
            if action == "lr_cool":
                self.job(job_id).cooling_until = 1 << 62
        if action == "lr_cool" and result in ("ended", "restored"):
            self.job(job_id).cooling_until = -1
        self.recent.append(dict(f.to_dict()))
        self.publish()

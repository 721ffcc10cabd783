"""What the engine reasons about and what it hands back: a condition, a decision, and the plan
for one condition (the decisions to carry out, each with its command and the ranks it goes
to), so the agent carries a plan out without asking the engine anything more."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from mscale import link
from mscale.findings import Finding
from mscale.healing import actions
from mscale.healing.target import Target, gpu_label, gpu_of


@dataclass(frozen=True, kw_only=True)
class Condition:  # built with keywords: two leading strings and a mapping, easy to swap
    kind: str  # "reason" (a Finding's reason code) or "alert" (an Alertmanager alert name)
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    source: str = ""
    severity: str = ""
    time: float = 0.0
    step: int | None = None  # in-process: the training step it was seen at
    # in-process: what makes it new evidence (acted on once per occurrence, not per time
    # window); None: deduplicated by the policy's dedup_window_s
    occurrence: Hashable | None = None

    @classmethod
    def of(cls, f: Finding, step: int | None = None, occurrence: Hashable | None = None) -> Condition:
        return cls(
            kind="reason",
            name=f.reason.value,
            labels=dict(f.labels),
            source=f.source,
            severity=f.severity.value,
            time=f.time,
            step=step,
            occurrence=occurrence,
        )


@dataclass(frozen=True, kw_only=True)
class Decision:  # built with keywords: nine fields, four of them strings, read by name
    rule: str
    action: str
    level: str  # L1, L2, L3 or none
    target: Target
    before: str  # the target's level when decided
    reason: str  # the condition (reason code or alert name)
    why: str = ""
    step: int | None = None  # the training step (in-process), None in the agent
    time: float = 0.0

    @property
    def fault_key(self) -> str:
        t = self.target
        return "/".join((self.rule, t.job_id, t.mpu_id, t.gpu_key))

    def command(self, *, end: bool = False) -> link.Heal:
        """The link command carrying this decision to a job (`end`: end what the action
        started, e.g. a cooling window whose alert resolved)."""
        t = self.target
        return link.Heal(
            self.action,
            rule=self.rule,
            level=self.level,
            mpu_id=t.mpu_id,
            gpu=gpu_label(t.gpu),
            gpu_uuid=t.gpu_uuid,
            reason=self.reason,
            why=self.why,
            fault_key=self.fault_key,
            decided_at=self.time,
            end=True if end else None,
        )

    @classmethod
    def from_command(cls, cmd: link.Heal, job_id: str) -> Decision:
        spec = actions.get(cmd.action)  # KeyError names the known actions
        return cls(
            rule="command" if cmd.rule is None else cmd.rule,
            action=cmd.action,
            level=spec.level,
            target=Target(job_id=job_id, mpu_id=cmd.mpu_id or "", gpu=gpu_of(cmd.gpu), gpu_uuid=cmd.gpu_uuid or ""),
            before="",
            reason="command" if cmd.reason is None else cmd.reason,
            why=cmd.why or "",
            time=cmd.decided_at or 0.0,
        )


@dataclass(frozen=True)
class Step:
    """One decision of a plan: the command that carries it, and the ranks it goes to (None:
    every rank of the job)."""

    decision: Decision
    command: link.Heal
    ranks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Plan:
    """What to do about one condition. `result`: acted, duplicate, rate_limited (no action
    fitted the budget), resolved or none (no rule, or the job acts on it in-process);
    `steps` the decisions to send, `ends` the end commands of a resolved alert (what its
    firing started), `rate_limited` the actions past the budget (already booked)."""

    result: str
    steps: tuple[Step, ...] = ()
    ends: tuple[Step, ...] = ()
    rate_limited: int = 0

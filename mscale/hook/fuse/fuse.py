"""The three-level fuse inside the training process: a Guard plugin.

    guard = Guard(model, optimizer, job_id="run-42")
    guard.add_plugin(FusePlugin(snapshot_engine=engine))   # engine: mscale.snapshot.engine.SnapshotEngine

Detections that must act within the step are decided here, with the same policy and engine
as the agent (mscale.healing.engine): checksum failures of an MPU (N consecutive failing
steps at its current placement escalate it one fuse level: L1 swap, L2 degrade, L3 distil),
loss spikes (LR cooled for a window; a spike that persists rolls back) and non-finite loss
(the step's update dropped, rollback to the last good snapshot, the batch skipped). The
agent's decisions (GPU faults: emergency snapshot, quarantine, swap; alerts) arrive as
`{"type": "heal", ...}` commands at step boundaries; `{"type": "heal", "end": true, ...}`
ends what an action started (a cooling window whose alert resolved). Every decision and
every state change is a finding (HEAL_ACTION, FUSE_STATE) that the guard logs and reports to
the agent.

The plugin is a dispatcher: each action's executor (mscale.hook.fuse.actions) carries it out and keeps
its own per-job state (`states[name]`: the quarantined GPUs, the degraded MPUs, the cooling
window, the pending rollback...), and declares on its spec what the plugin must do around it
(re-run the MPU's forward, start a new placement, escalate when it fails). The plugin counts
failing steps per placement, runs the engine's decisions, re-runs forwards, and passes the
guard's hooks on to the action states.

An action applied inside a forward that moves the MPU (L1 swap, L2 degrade) discards the MPU's
output and re-runs its forward for the same batch on the new placement (the guard's
on_mpu_output hook), so the step completes correctly. Sharded (FSDP2), that forward would all-gather
on this rank alone: every rank re-runs the step instead (docs/healing.md#under-fsdp2).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, SupportsFloat, TypeVar

import structlog

from mscale import link
from mscale.findings import Finding, Reason
from mscale.healing import actions
from mscale.healing import policy as policymod
from mscale.healing.actions.base import ActionSpec
from mscale.healing.engine import Condition, Decision, HealingEngine, HealingSnapshot, Target
from mscale.healing.fsm import Level
from mscale.healing.policy import Policy, Rule
from mscale.healing.progress import Keeper, ProgressBoundExceeded
from mscale.healing.settings import HealingSection
from mscale.healing.target import gpu_of
from mscale.healing.words import Result, TargetKind
from mscale.hook.fuse import actions as executors
from mscale.hook.fuse.actions.base import ActionFailed
from mscale.snapshot.sharded import is_sharded

if TYPE_CHECKING:
    from mscale.hook.core.guard import Guard
    from mscale.hook.core.mpu import Mpu
    from mscale.hook.core.outputs import ModelInputs
    from mscale.snapshot.engine import SnapshotEngine

log = structlog.get_logger("mscale.fuse")
SOURCE = "fuse"
_FAIL = (Reason.CHECKSUM_FAILURE, Reason.NONFINITE_OUTPUT)
_OWN = (Reason.HEAL_ACTION, Reason.FUSE_STATE, Reason.CHECKSUM_L1_TRIGGER)  # the trigger: counted here
MAX_RERUNS = 3  # forward re-runs of one MPU in one step (one per escalation)
S = TypeVar("S")


def _finite(v: SupportsFloat) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


@dataclass
class Placement:
    """Consecutive failing steps of one MPU at its current placement (an action with
    `new_placement` starts a new one)."""

    failures: int = 0
    epoch: int = 0
    counted: tuple[int, int] = (-1, -1)  # (seq, epoch) last counted


class FusePlugin:
    def __init__(
        self,
        *,
        config: HealingSection | None = None,
        policy: Policy | str | None = None,
        snapshot_engine: SnapshotEngine | None = None,
        gpu_count: int | None = None,
        l2_resolution: float = 0.5,
        l2_clip_factor: float = 2.0,
        l2_precision_fallback: bool | None = None,
        drive_snapshots: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = config or HealingSection()
        self.policy = policy if isinstance(policy, Policy) else policymod.load(policy or self.cfg.policy)
        self.snapshot_engine = snapshot_engine
        self.drive_snapshots = drive_snapshots  # call snapshot_engine.step_end after each good step
        self.gpu_count = gpu_count  # GPUs of the node (None: CUDA's count, or 8 simulated)
        self.l2_resolution = l2_resolution
        self.l2_clip_factor = l2_clip_factor
        # None: the config's; bf16 on CPU loosens the checksums, so it is opt-in
        self.l2_precision_fallback = (
            self.cfg.l2_precision_fallback if l2_precision_fallback is None else l2_precision_fallback
        )
        self.clock = clock
        self._guard: Guard | None = None  # from on_attach on (`guard`)
        self.engine: HealingEngine | None = None
        self.books: HealingSnapshot | None = None  # the engine's latest published books (the exporter reads them)
        self.seq = 0  # steps run (unlike the training step, it never goes back on a rollback)
        # each action's per-job state, in registry order
        self.states: dict[str, object] = {e.name: e.state(self) for e in executors.executors() if e.state is not None}
        self.placement: dict[str, Placement] = {}
        self.pending_rerun: set[str] = set()
        self.failed_step: set[str] = set()
        self.step_dropped = False  # an action dropped this step's update
        self.reruns: list[tuple[int, str, int, float]] = []  # (step, mpu_id, gpu, when done) of each re-run
        self._rerunning: str | None = None
        self.ask_standby: Callable[[Mpu, Iterable[int]], int | None] | None = None  # the agent's choice (protect.py)
        self.progress = Keeper(self)  # forward progress: lost calls per culprit, the bound (mscale.healing.progress)
        self._thread = threading.get_ident()
        self._foreign: deque[Finding] = deque()

    # --- what the actions use ------------------------------------------------------------

    def dispatch(self, hook: str, *args: object) -> list[object]:
        """Call `hook(self, *args)` on every action state that has it (registry order); their results."""
        return [getattr(st, hook)(self, *args) for st in self.states.values() if hasattr(st, hook)]

    def state_of(self, kind: type[S]) -> S | None:
        """The action state of type `kind` (mscale.hook.fuse.actions: `Rollbacks`, `Degraded`...),
        None when no action keeps one."""
        return next((st for st in self.states.values() if isinstance(st, kind)), None)

    def record(self, d: Decision, result: str, *, detail: str = "") -> None:
        """Book the outcome of `d` in the engine (an event, the counters, the MPU's state)."""
        self._engine.record(d, result, detail=detail)

    def rerun_step(self, why: str) -> str:
        """A fault found at the commit point (the guard's `request_rerun`): the step's update is
        dropped, the failed run charged to its culprit, and the step run again once on its batch
        from its start (healing.progress_step_reruns; past it the batch is skipped): see
        mscale.healing.progress."""
        return self.progress.rerun(why)

    def may_keep_update(self) -> bool:
        """Whether a step whose run again failed at the commit point may keep its update (the
        failing MPUs' gradients dropped): nothing but the checks asked to drop it, and its loss
        is finite. With several ranks from the agreed figures only, so every rank decides alike."""
        g = self.guard
        agreement = getattr(g, "agreement", None)
        last = agreement.history[-1] if agreement is not None and agreement.history else None
        if last is not None and last.step == g.current_step:
            return not (last.skip or last.nonfinite or last.gradient)
        state = g.step_state
        if state.skip_reason != state.rerun_reason or not all(_finite(v) for v in state.losses):
            return False
        return not any(f.reason is Reason.NONFINITE_OUTPUT for f in state.findings)

    def keep_update(self, why: str) -> None:
        """The step's update kept but the gradients of the MPUs that failed in it (on any rank:
        the agreed culprits), whose parameters stay as they were; see `may_keep_update`."""
        g = self.guard
        agreement = getattr(g, "agreement", None)
        last = agreement.history[-1] if agreement is not None and agreement.history else None
        failed = set(last.failed_mpus) if last is not None and last.step == g.current_step else self.failed_step
        for m in g.mpus:
            if m.mpu_id in failed:
                for p in m.parameters():
                    p.grad = None
        g.step_state.skip_reason = ""
        log.info("step_kept", step=g.current_step, dropped=sorted(failed), why=why)

    @property
    def stopping(self) -> ProgressBoundExceeded | None:
        """The mscale.ProgressBoundExceeded the guard raises (None: training goes on)."""
        return self.progress.stopping

    def drop_step(self, why: str) -> None:
        """Drop this step's update (the guard skips the optimizer step)."""
        self.guard.request_skip(why)
        self.step_dropped = True

    @property
    def guard(self) -> Guard:
        """The guard the plugin is attached to, from `on_attach` on."""
        if self._guard is None:
            raise RuntimeError("the fuse plugin is not attached to a guard")
        return self._guard

    @property
    def _engine(self) -> HealingEngine:
        """The engine, which exists from `on_attach` on."""
        if self.engine is None:
            raise RuntimeError("the fuse plugin is not attached to a guard")
        return self.engine

    @property
    def cooling(self) -> bool:
        """The job's LR cooling window is open (the engine's books)."""
        return self.engine is not None and self.engine.job(self.guard.job_id).cooling

    # --- plugin hooks --------------------------------------------------------------------

    def on_attach(self, guard: Guard) -> None:
        self._guard = guard
        self._thread = threading.get_ident()
        self.engine = HealingEngine(
            self.policy, self.cfg, source=SOURCE, clock=self.clock, emit=guard.emit, publish=self._published
        )
        for m in guard.mpus:
            m.fuse_level = Level.HEALTHY.value
            self.engine.mpu(guard.job_id, m.mpu_id)
        self.engine.publish()
        self.dispatch("attach")

    def on_detach(self, guard: Guard) -> None:
        self.dispatch("detach")

    def snapshot_emit(self, f: Finding) -> None:
        """`emit` for the snapshot engine: its writer thread's findings reach the guard in the
        training thread, at the next hook call, as the guard expects."""
        if self._guard is not None and threading.get_ident() == self._thread:
            self.guard.emit(f)
        else:
            self._foreign.append(f)

    def _drain(self) -> None:
        while self._foreign:
            self.guard.emit(self._foreign.popleft())

    def on_step_begin(self, step: int, batch: object) -> None:
        self._drain()
        self.seq += 1
        self.failed_step = set()
        self.pending_rerun = set()
        self.step_dropped = False
        self.dispatch("step_begin")

    def on_report(self, report: link.StepReport) -> None:
        self.dispatch("report", report)  # actions add what they changed (L3: the loss returned)

    def on_finding(self, f: Finding) -> None:
        if f.source == SOURCE or f.reason in _OWN:
            return
        mpu_id = f.labels.get("mpu_id", "")
        if f.reason in _FAIL and mpu_id:
            self._mpu_failed(mpu_id, f)
            return
        self._decide(Condition.of(f, step=self.guard.current_step, occurrence=self.seq))

    def on_mpu_output(self, mpu: Mpu, inputs: ModelInputs, output: object) -> object:
        if self._rerunning is not None:
            return None
        self.dispatch("mpu_output", mpu, output)
        if mpu.mpu_id not in self.pending_rerun:
            return None
        if is_sharded(self.guard.model):  # FSDP2: a forward on this rank alone would all-gather alone
            self.pending_rerun.discard(mpu.mpu_id)
            self.guard.request_rerun(f"{mpu.name} ({mpu.mpu_id}) moved in the step; sharded: step re-run by every rank")
            log.info("mpu_rerun_collective", mpu_id=mpu.mpu_id, step=self.guard.current_step)
            return None
        out = None
        for _ in range(MAX_RERUNS):
            if mpu.mpu_id not in self.pending_rerun:
                break
            self.pending_rerun.discard(mpu.mpu_id)
            self._rerunning = mpu.mpu_id
            try:  # the discarded output's graph is dropped with it; this one carries the gradients
                out = mpu.module(*inputs.args, **inputs.kwargs)
            finally:
                self._rerunning = None
        if out is not None:
            self.dispatch("mpu_output", mpu, out)
            self.reruns.append((self.guard.current_step, mpu.mpu_id, mpu.gpu, time.time()))
            log.info("mpu_rerun", mpu_id=mpu.mpu_id, gpu=mpu.gpu, step=self.guard.current_step)
        return out

    def on_step_end(self, step: int, loss: float | None) -> None:
        self._drain()
        self.dispatch("step_end", step)
        for m in self.guard.mpus:
            if m.mpu_id in self.failed_step:
                continue
            self.placement.setdefault(m.mpu_id, Placement()).failures = 0
            tr = self._engine.clean_step(self.guard.job_id, m.mpu_id, step)
            if tr is not None:
                m.fuse_level = tr.after.value
                if tr.after is Level.RECOVERED and any(self.dispatch("in_force", m)):
                    spec = actions.recovery()
                    self.run(
                        Decision(
                            rule="recovery",
                            action=spec.name,
                            level=spec.level,
                            target=self._target(m),
                            before=tr.before.value,
                            reason="clean_steps",
                            why=f"{self.cfg.recovery_clean_steps} clean steps",
                            step=step,
                            time=self.clock(),
                        )
                    )
        replaced = any(self.dispatch("settle", step))  # a rollback: the step's state is not kept
        self.progress.step_end()
        if not replaced:
            self.dispatch("weights_settled")
            if self.snapshot_engine is not None and self.drive_snapshots:
                self.snapshot_engine.step_end(step)

    def on_command(self, command: link.Wire) -> link.Wire | None:
        if command.get("type") != link.Command.HEAL:
            return None
        try:
            heal = link.Heal.from_wire(command)
            d = Decision.from_command(heal, self.guard.job_id)
        except (KeyError, ValueError) as e:
            return {"ok": False, "error": str(e)}
        ex = executors.get(d.action)
        if heal.end:
            if ex.end is None:
                return {"ok": False, "error": f"{d.action}: nothing to end"}
            ex.end(self, self.states.get(ex.name), d.why or f"{d.reason} ended")
            return {"ok": True}
        if d.target.mpu_id:
            try:
                m = self.guard.mpu(d.target.mpu_id)
            except KeyError as e:
                return {"ok": False, "error": str(e)}
            d = replace(
                d,
                target=self._target(m, d.target.gpu, d.target.gpu_uuid),
                before=m.fuse_level,
                step=self.guard.current_step,
            )
        result = self.run(d)
        return {"ok": result in (Result.APPLIED, Result.NOOP), "result": result}

    # --- deciding and acting -------------------------------------------------------------

    def _target(self, m: Mpu, gpu: int | None = None, gpu_uuid: str = "") -> Target:
        if gpu is None:
            return Target(self.guard.job_id, m.mpu_id, m.gpu, m.gpu_uuid)
        return Target(self.guard.job_id, m.mpu_id, gpu, gpu_uuid or (m.gpu_uuid if gpu == m.gpu else ""))

    def _targets(self, rule: Rule, cond: Condition) -> list[Target]:
        if rule.target == TargetKind.JOB:
            return [Target(self.guard.job_id)]
        key = cond.labels.get("mpu_id", "")
        if rule.target == TargetKind.GPU:
            gpu = gpu_of(cond.labels.get("gpu"))
            return [self._target(m) for m in self.guard.mpus if m.gpu == gpu]
        return [self._target(m) for m in self.guard.mpus if key in (m.mpu_id, m.name)]

    def _decide(self, cond: Condition) -> None:
        for d in self._engine.decide(cond, self._targets):
            self.run(d)

    def run(self, d: Decision) -> str:
        """Carry out one decision; book it. An action that fails and declares an escalation
        on failure (a swap with no standby) runs its escalation instead."""
        ex = executors.get(d.action)
        spec = ex.spec
        state = self.states.get(spec.name)
        try:
            result = ex.apply(self, state, d)
        except ActionFailed as e:
            self._engine.record(d, Result.FAILED, detail=str(e))
            if spec.escalate_on_failure and spec.escalates_to:
                nxt = actions.get(spec.escalates_to)
                return self.run(
                    replace(d, action=nxt.name, level=nxt.level, why=f"{spec.level} impossible: {e}", time=self.clock())
                )
            return Result.FAILED
        except Exception as e:  # an action bug must not break the step; the event says what
            log.exception("heal_action_error", action=d.action)
            self._engine.record(d, Result.FAILED, detail=repr(e))
            return Result.FAILED
        detail, extra = ex.event(state, d) if ex.event is not None and result == Result.APPLIED else ("", {})
        if result != Result.DEFERRED:  # the action books its one event itself, later
            self._engine.record(d, result, detail=detail, labels=extra)
        if d.target.mpu_id:
            m = self.guard.mpu(d.target.mpu_id)
            m.fuse_level = self._engine.mpu(self.guard.job_id, m.mpu_id).level.value
            if result == Result.APPLIED and spec.new_placement:
                p = self.placement.setdefault(m.mpu_id, Placement())
                p.failures, p.epoch = 0, p.epoch + 1
                if spec.reruns_forward and self._in_forward():
                    self.pending_rerun.add(m.mpu_id)
        return result

    def reduction_failed(self, m: Mpu, spec: ActionSpec, detail: str) -> None:
        """A measure of `spec` in force on `m` failed while running (its action state undid it):
        book a failed event of that action and run the next level's action."""
        step = self.guard.current_step
        target, level = self._target(m), m.fuse_level
        here = Decision(
            rule="fuse",
            action=spec.name,
            level=spec.level,
            target=target,
            before=level,
            reason="action_error",
            why=detail,
            step=step,
            time=self.clock(),
        )
        self._engine.record(here, Result.FAILED, detail=detail)
        if spec.escalates_to:
            nxt = actions.get(spec.escalates_to)
            failed = replace(
                here, action=nxt.name, level=nxt.level, why=f"{spec.level} failed: {detail}", time=self.clock()
            )
            self.run(failed)

    def _in_forward(self) -> bool:
        # between the step's first forward and the optimizer step (not at a step boundary),
        # in a step whose update is kept
        return self.guard.step_state.in_step and not self.step_dropped

    def _mpu_failed(self, mpu_id: str, f: Finding) -> None:
        try:
            m = self.guard.mpu(mpu_id)
        except KeyError:
            return
        if any(self.dispatch("mpu_failed", m, f)):
            return  # its weights were corrupted and are repaired (restore_weights): not the device
        self.failed_step.add(m.mpu_id)
        self._engine.mpu(self.guard.job_id, m.mpu_id).failed()
        p = self.placement.setdefault(m.mpu_id, Placement())
        if p.counted == (self.seq, p.epoch):
            return  # one count per step and placement
        first_in_step = p.counted[0] != self.seq
        p.counted = (self.seq, p.epoch)
        p.failures += 1
        step = self.guard.current_step
        if first_in_step:
            self._decide(Condition.of(f, step=step, occurrence=self.seq))  # healthy -> suspect
        if p.failures >= self.cfg.checksum_failures_l1:
            labels = {**f.labels, "consecutive": str(p.failures)}
            # one trigger per step and placement: a failure on the new placement in the same
            # step is new evidence (it escalates), a second finding at the old one is not
            self._decide(
                Condition(
                    kind="reason",
                    name=Reason.CHECKSUM_L1_TRIGGER.value,
                    labels=labels,
                    source=SOURCE,
                    severity="critical",
                    time=self.clock(),
                    step=step,
                    occurrence=(self.seq, p.epoch),
                )
            )

    def _published(self, books: HealingSnapshot) -> None:
        self.books = books

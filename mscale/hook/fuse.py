"""The three-level fuse inside the training process: a Guard plugin.

    guard = mscale.attach(model, optimizer, job_id="run-42")
    guard.add_plugin(Fuse(snapshots=snapshot_engine))

Detections that must act within the step are decided here, with the same policy and engine
as the agent (mscale.healing.engine): checksum failures of an MPU (N consecutive failing
steps at its current placement escalate it one fuse level: L1 swap, L2 degrade, L3 distil),
loss spikes (LR cooled for a window; a spike that persists rolls back) and non-finite loss
(the step's update dropped, rollback to the last good snapshot, the batch skipped). The
agent's decisions (GPU faults: emergency snapshot, quarantine, swap; alerts) arrive as
`{"type": "heal", ...}` commands at step boundaries. Every decision and every state change is
a finding (HEAL_ACTION, FUSE_STATE) that the guard logs and reports to the agent.

An L1 swap inside a forward discards the MPU's output and re-runs its forward for the same
batch on the standby (the guard's on_mpu_output hook), so the step completes correctly.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import structlog
import torch
from torch.nn import functional as F

from mscale.findings import Finding, Reason
from mscale.healing import actions, policy as policymod
from mscale.healing.actions.base import ActionFailed
from mscale.healing.engine import Condition, Decision, HealingEngine, HealingSnapshot, Target
from mscale.healing.fsm import Level
from mscale.healing.policy import Policy, Rule
from mscale.healing.settings import HealingSection

log = structlog.get_logger("mscale.fuse")
SOURCE = "fuse"
_FAIL = (Reason.CHECKSUM_FAILURE, Reason.NONFINITE_OUTPUT)
_OWN = (Reason.HEAL_ACTION, Reason.FUSE_STATE, Reason.CHECKSUM_L1_TRIGGER)  # the trigger: counted here
MAX_RERUNS = 3  # forward re-runs of one MPU in one step (one per escalation)


@dataclass
class Distill:
    """L3 state of one MPU: the KL weight, adapted so the term is a fixed share of the loss."""

    mpu_id: str
    weight: float = 0.0
    share: float = 0.0  # the KL term's share of the total loss at the last step


@dataclass
class Placement:
    """Consecutive failing steps of one MPU at its current placement (reset by every action)."""

    failures: int = 0
    epoch: int = 0
    counted: tuple[int, int] = (-1, -1)  # (seq, epoch) last counted


class Fuse:
    def __init__(self, *, config: HealingSection | None = None, policy: Policy | str | None = None,
                 snapshots: Any = None, gpu_count: int | None = None, l2_resolution: float = 0.5,
                 l2_clip_factor: float = 2.0, l2_precision_fallback: bool | None = None,
                 drive_snapshots: bool = True,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg = config or HealingSection()
        self.policy = policy if isinstance(policy, Policy) else policymod.load(policy or self.cfg.policy)
        self.snapshots = snapshots  # an mscale.snapshot.engine.SnapshotEngine (or None)
        self.drive_snapshots = drive_snapshots  # call snapshots.step_end after each good step
        self.l2_resolution = l2_resolution
        self.l2_clip_factor = l2_clip_factor
        # None: the config's; bf16 on CPU loosens the checksums, so it is opt-in
        self.l2_precision_fallback = (self.cfg.l2_precision_fallback if l2_precision_fallback is None
                                      else l2_precision_fallback)
        self.clock = clock
        self._gpu_count = gpu_count
        self.guard: Any = None
        self.engine: HealingEngine | None = None
        self.snapshot: HealingSnapshot | None = None
        self.seq = 0  # steps run (unlike the training step, it never goes back on a rollback)
        self.quarantined: set[int] = set()
        self.failed_on: dict[str, set[int]] = {}
        self.last_swap: dict[str, tuple[int, int, bool]] = {}
        self.emergency_done: set[str] = set()
        self.placement: dict[str, Placement] = {}
        self.pending_rerun: set[str] = set()
        self.failed_step: set[str] = set()
        self.degraded: dict[str, tuple[Any, Any]] = {}  # mpu_id -> (resolution pre-hook handle, Fallback or None)
        self.distilling: dict[str, Distill] = {}
        self.rollbacks: list[dict] = []  # what each rollback did (tests, demo)
        self.skipped_steps: list[int] = []
        self.distill_shares: list[tuple[int, str, float, float]] = []  # (step, mpu_id, share of loss, weight)
        self.emergencies: list[Any] = []  # futures of emergency writes
        self.reruns: list[tuple[int, str, int, float]] = []  # (step, mpu_id, gpu, when done) of each re-run
        self._rerunning: str | None = None
        self._pending_rollback: Decision | None = None
        self._cool_until = -1  # last seq of the LR cooling window
        self._saved_lr: list[float] | None = None
        self._fingerprints: dict[str, torch.Tensor] = {}
        self._captured: dict[str, torch.Tensor] = {}
        self._handles: list[Any] = []
        self._thread = threading.get_ident()
        self._foreign: deque[Finding] = deque()

    # --- plugin hooks --------------------------------------------------------------------

    def on_attach(self, guard: Any) -> None:
        self.guard = guard
        self._thread = threading.get_ident()
        self.engine = HealingEngine(self.policy, self.cfg, source=SOURCE, clock=self.clock, emit=guard.emit,
                                    publish=self._published)
        for m in guard.mpus:
            m.fuse_level = Level.HEALTHY.value
            self.engine.fuse(guard.job_id, m.mpu_id)
            self._fingerprints[m.mpu_id] = self._fingerprint(m)
        self.engine.publish()
        # appended after the guard's own model hook: the loss detector watches the task loss,
        # backward gets the task loss plus the L3 term (a step up by design, not a spike)
        self._handles.append(guard.model.register_forward_hook(self._model_output))

    def on_detach(self, guard: Any) -> None:
        for mpu_id in list(self.distilling):
            self.distilling.pop(mpu_id)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for h, fallback in self.degraded.values():
            h.remove()
            if fallback is not None:
                fallback.undo()
        self.degraded.clear()

    def snapshot_emit(self, f: Finding) -> None:
        """`emit` for the snapshot engine: its writer thread's findings reach the guard in the
        training thread, at the next hook call, as the guard expects."""
        if self.guard is not None and threading.get_ident() == self._thread:
            self.guard.emit(f)
        else:
            self._foreign.append(f)

    def _drain(self) -> None:
        while self._foreign:
            self.guard.emit(self._foreign.popleft())

    def on_step_begin(self, step: int, batch: Any) -> None:
        self._drain()
        self.seq += 1
        self.failed_step = set()
        self.pending_rerun = set()
        self._captured = {}
        if self._cool_until >= self.seq:
            self._cool()

    def on_finding(self, f: Finding) -> None:
        if f.source == SOURCE or f.reason in _OWN:
            return
        mpu_id = f.labels.get("mpu_id", "")
        if f.reason in _FAIL and mpu_id:
            self._mpu_failed(mpu_id, f)
            return
        self._decide(Condition.of(f, step=self.seq))

    def on_mpu_output(self, mpu: Any, inputs: Any, output: Any) -> Any:
        if self._rerunning is not None:
            return None
        self._capture(mpu, output)
        if mpu.mpu_id not in self.pending_rerun:
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
            self._capture(mpu, out)
            self.reruns.append((self.guard.current_step, mpu.mpu_id, mpu.gpu, time.time()))
            log.info("mpu_rerun", mpu_id=mpu.mpu_id, gpu=mpu.gpu, step=self.guard.current_step)
        return out

    def on_step_end(self, step: int, loss: float | None) -> None:
        self._drain()
        if self._saved_lr is not None:
            self._uncool()
        if self._cool_until >= 0 and self.seq >= self._cool_until:
            self._end_cooling("window over")
        for d in self.distilling.values():
            self.distill_shares.append((step, d.mpu_id, d.share, d.weight))
        for m in self.guard.mpus:
            if m.mpu_id in self.failed_step:
                continue
            self.placement.setdefault(m.mpu_id, Placement()).failures = 0
            tr = self.engine.clean_step(self.guard.job_id, m.mpu_id, step)
            if tr is not None:
                m.fuse_level = tr.after.value
                if tr.after is Level.RECOVERED and (m.mpu_id in self.degraded or m.mpu_id in self.distilling):
                    self._run(Decision("recovery", "recover", "none", self._target(m), tr.before.value,
                                       "clean_steps", f"{self.cfg.recovery_clean_steps} clean steps", self.seq,
                                       self.clock()))
        if self._pending_rollback is not None:
            d, self._pending_rollback = self._pending_rollback, None
            self._rollback(d, step)
            return
        for m in self.guard.mpus:
            self._fingerprints[m.mpu_id] = self._fingerprint(m)
        if self.snapshots is not None and self.drive_snapshots:
            self.snapshots.step_end(step)

    def on_command(self, command: dict) -> dict | None:
        if command.get("type") != "heal":
            return None
        if command.get("action") == "lr_cool" and command.get("end"):
            self._end_cooling(f"alert {command.get('reason', '')} resolved")
            return {"ok": True}
        try:
            d = Decision.from_command(command, self.guard.job_id)
        except KeyError as e:
            return {"ok": False, "error": str(e)}
        if d.target.mpu_id:
            try:
                m = self.guard.mpu(d.target.mpu_id)
            except KeyError as e:
                return {"ok": False, "error": str(e)}
            d = Decision(d.rule, d.action, d.level, self._target(m, d.target.gpu, d.target.gpu_uuid), m.fuse_level, d.reason,
                         d.why, self.seq, d.time)
        result = self._run(d)
        return {"ok": result in ("applied", "noop"), "result": result}

    # --- deciding and acting -------------------------------------------------------------

    def _target(self, m: Any, gpu: str | None = None, gpu_uuid: str = "") -> Target:
        if gpu in (None, ""):
            return Target(self.guard.job_id, m.mpu_id, str(m.gpu), m.gpu_uuid)
        return Target(self.guard.job_id, m.mpu_id, gpu, gpu_uuid or (m.gpu_uuid if gpu == str(m.gpu) else ""))

    def _targets(self, rule: Rule, cond: Condition) -> list[Target]:
        if rule.target == "job":
            return [Target(self.guard.job_id)]
        key = cond.labels.get("mpu_id", "")
        if rule.target == "gpu":
            gpu = cond.labels.get("gpu", "")
            return [self._target(m) for m in self.guard.mpus if str(m.gpu) == gpu]
        return [self._target(m) for m in self.guard.mpus if key in (m.mpu_id, m.name)]

    def _decide(self, cond: Condition) -> None:
        for d in self.engine.decide(cond, self._targets):
            self._run(d)

    def _run(self, d: Decision) -> str:
        """Carry out one decision; book it. A swap with no standby escalates to L2."""
        spec = actions.get(d.action)
        try:
            result = spec.apply(self, d)
        except ActionFailed as e:
            self.engine.record(d, "failed", detail=str(e))
            if d.action == "l1_swap":
                esc = Decision(d.rule, "l2_degrade", "L2", d.target, d.before, d.reason, f"L1 impossible: {e}",
                               d.step, self.clock())
                return self._run(esc)
            return "failed"
        except Exception as e:  # an action bug must not break the step; the event says what
            log.exception("heal_action_error", action=d.action)
            self.engine.record(d, "failed", detail=repr(e))
            return "failed"
        extra = {}
        if d.action == "l1_swap" and result == "applied" and d.target.mpu_id in self.last_swap:
            extra["to_gpu"] = str(self.last_swap[d.target.mpu_id][1])
        if d.action == "l2_degrade" and result == "applied" and d.target.mpu_id in self.fallbacks:
            extra["fallback"] = self.fallbacks[d.target.mpu_id]
        self.engine.record(d, result, detail=self._detail(d), labels=extra)
        if d.target.mpu_id:
            m = self.guard.mpu(d.target.mpu_id)
            m.fuse_level = self.engine.fuse(self.guard.job_id, m.mpu_id).level.value
            if result == "applied" and spec.moves_to is not None and d.action not in ("mark_suspect", "recover"):
                p = self.placement.setdefault(m.mpu_id, Placement())
                p.failures, p.epoch = 0, p.epoch + 1
                if self.guard._in_step and d.action in ("l1_swap", "l2_degrade") and self._in_forward():
                    self.pending_rerun.add(m.mpu_id)
        return result

    def _detail(self, d: Decision) -> str:
        if d.action == "l1_swap" and d.target.mpu_id in self.last_swap:
            old, new, restored = self.last_swap[d.target.mpu_id]
            return f"gpu {old} -> {new}" + (", weights restored from the snapshot" if restored else "")
        if d.action == "l2_degrade" and d.target.mpu_id in self.degraded:
            kind = self.fallbacks.get(d.target.mpu_id)
            where = {"cpu": "moved to the CPU, ", "bf16": "forward in bf16, "}.get(kind or "", "")
            return f"{where}inputs at {self.l2_resolution:g}x resolution"
        return ""

    def _in_forward(self) -> bool:
        # between the step's first forward and the optimizer step (not at a step boundary)
        return self.guard._in_step and self._pending_rollback is None

    def _mpu_failed(self, mpu_id: str, f: Finding) -> None:
        try:
            m = self.guard.mpu(mpu_id)
        except KeyError:
            return
        self.failed_step.add(m.mpu_id)
        self.engine.fuse(self.guard.job_id, m.mpu_id).failed()
        p = self.placement.setdefault(m.mpu_id, Placement())
        if p.counted == (self.seq, p.epoch):
            return  # one count per step and placement
        first_in_step = p.counted[0] != self.seq
        p.counted = (self.seq, p.epoch)
        p.failures += 1
        if first_in_step:
            self._decide(Condition.of(f, step=self.seq))  # healthy -> suspect
        if p.failures >= self.cfg.checksum_failures_l1:
            labels = {**f.labels, "consecutive": str(p.failures)}
            self._decide(Condition("reason", Reason.CHECKSUM_L1_TRIGGER.value, labels, SOURCE, "critical",
                                   self.clock(), step=self.seq * 100 + p.epoch))

    def _published(self, snap: HealingSnapshot) -> None:
        self.snapshot = snap

    # --- what the actions use ------------------------------------------------------------

    @property
    def gpu_count(self) -> int:
        if self._gpu_count is None:
            if torch.cuda.is_available():
                self._gpu_count = torch.cuda.device_count()
            else:
                self._gpu_count = max(8, 1 + max(m.gpu for m in self.guard.mpus))
        return self._gpu_count

    def standby_for(self, m: Any) -> int | None:
        """A healthy GPU for `m`: not quarantined, no MPU of this job failed on it (an SDC
        there may hit any MPU), preferably unused."""
        bad = self.quarantined | set().union(*self.failed_on.values()) | {m.gpu}
        used = {o.gpu for o in self.guard.mpus if o is not m}
        free = [g for g in range(self.gpu_count) if g not in bad and g not in used]
        shared = [g for g in range(self.gpu_count) if g not in bad and g in used]
        return (free or shared or [None])[0]

    def move_mpu(self, m: Any, gpu: int) -> None:
        """Rebind `m` to GPU `gpu`: on a GPU node its parameters, gradients and optimizer
        state move to that device; on CPU the simulated binding moves."""
        device = None
        if m.device.type == "cuda":
            device = torch.device("cuda", gpu)
        self.guard.rebind(m, gpu, device=device)
        if device is not None and self.guard.optimizer is not None:
            for p in m.parameters():
                for k, v in self.guard.optimizer.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor) and v.device != device and v.dim() > 0:
                        self.guard.optimizer.state[p][k] = v.to(device)

    @staticmethod
    def _fingerprint(m: Any) -> torch.Tensor:
        with torch.no_grad():
            return torch.stack([p.detach().double().sum() for p in m.module.parameters()]) \
                if any(True for _ in m.module.parameters()) else torch.zeros(0)

    def verify_weights(self, m: Any) -> bool:
        """Check the MPU's weights against their fingerprint after the last optimizer step;
        on a mismatch (corrupted in place) restore them from the last in-memory snapshot.
        True when restored."""
        now = self._fingerprint(m)
        ref = self._fingerprints.get(m.mpu_id)
        if ref is None or (now.shape == ref.shape and torch.equal(now, ref)):
            return False
        snap = self.snapshots.latest() if self.snapshots is not None else None
        if snap is None:
            raise ActionFailed("weights fail their checksum and no in-memory snapshot can restore them")
        snap.wait_ready()
        params = dict(self.guard.model.named_parameters())
        state = self.guard.model.state_dict(keep_vars=True)
        opt = self.guard.optimizer
        n = 0
        with torch.no_grad():
            for fname, tensors in snap.tensors.items():
                if not fname.startswith(f"mpu_{m.mpu_id}_"):
                    continue
                for key, saved in tensors.items():
                    kind, _, rest = key.partition("/")
                    if kind == "model" and rest in state:
                        state[rest].copy_(saved)
                        n += 1
                    elif kind == "optim" and opt is not None:
                        fqn, _, k = rest.rpartition("/")
                        p = params.get(fqn)
                        if p is not None and isinstance(opt.state.get(p, {}).get(k), torch.Tensor):
                            opt.state[p][k].copy_(saved)
        if not n:
            raise ActionFailed(f"the in-memory snapshot of step {snap.step} holds no weights of MPU {m.mpu_id}")
        self._fingerprints[m.mpu_id] = self._fingerprint(m)
        log.warning("mpu_weights_restored", mpu_id=m.mpu_id, snapshot_step=snap.step, tensors=n)
        return True

    # L2 ---------------------------------------------------------------------------------

    @property
    def fallbacks(self) -> dict[str, str]:
        """The fallback each degraded MPU runs on: mpu_id -> "cpu" or "bf16"."""
        return {k: fb.kind for k, (_, fb) in self.degraded.items() if fb is not None}

    def degrade(self, m: Any) -> None:
        if m.mpu_id in self.degraded:
            return
        from mscale.healing.actions.degrade import run_degraded
        scale = self.l2_resolution

        def reduce(module: Any, args: tuple, kwargs: dict) -> tuple | None:
            if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() != 4 or not args[0].is_floating_point():
                return None  # only image-like inputs (B, C, H, W) are reduced
            x = args[0]
            size = (max(1, int(x.shape[-2] * scale)), max(1, int(x.shape[-1] * scale)))
            return (F.interpolate(x, size=size, mode="bilinear", align_corners=False), *args[1:]), kwargs

        fallback = run_degraded(m.module, self.guard.optimizer, precision=self.l2_precision_fallback)
        if fallback is not None:
            self.guard.checksum.forget(m)  # its cached weight sums (the weights may have moved)
        self.degraded[m.mpu_id] = (m.module.register_forward_pre_hook(reduce, with_kwargs=True), fallback)
        log.warning("mpu_degraded", mpu_id=m.mpu_id, fallback=fallback.kind if fallback else "none",
                    device=str(m.device))
        if self.guard.cmsa is not None:
            self.guard.cmsa.raise_threshold(m, self.l2_clip_factor)

    def undegrade(self, m: Any) -> None:
        h, fallback = self.degraded.pop(m.mpu_id, (None, None))
        if h is None:
            return
        h.remove()
        if fallback is not None:
            fallback.undo()
            self.guard.checksum.forget(m)
        if self.guard.cmsa is not None:
            self.guard.cmsa.reset_threshold(m)

    # L3 ---------------------------------------------------------------------------------

    def start_distill(self, m: Any) -> None:
        self.distilling.setdefault(m.mpu_id, Distill(m.mpu_id))

    def stop_distill(self, m: Any) -> None:
        self.distilling.pop(m.mpu_id, None)

    def _capture(self, mpu: Any, output: Any) -> None:
        if not self.distilling or mpu.name not in ("aligner", "text"):
            return
        t = output[1] if mpu.name == "text" and isinstance(output, tuple) and len(output) > 1 else output
        t = getattr(t, "last_hidden_state", t)
        if isinstance(t, (tuple, list)):
            t = t[0]
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            self._captured[mpu.name] = t

    def _model_output(self, module: Any, args: tuple, output: Any) -> Any:
        """L3: add the KL term to the loss the model returns (before backward sees it)."""
        if not self.distilling or not module.training:
            return None
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        proj, text = self._captured.get("aligner"), self._captured.get("text")
        if not isinstance(loss, torch.Tensor) or proj is None or text is None:
            return None
        student = proj.float().mean(dim=1)  # (B, H): the failing MPU's output as the text model receives it
        teacher = text[:, proj.shape[1]:].detach().float().mean(dim=1) if text.shape[1] > proj.shape[1] \
            else text.detach().float().mean(dim=1)
        if student.shape != teacher.shape:
            return None
        kl = F.kl_div(F.log_softmax(student, dim=-1), F.log_softmax(teacher, dim=-1), log_target=True,
                      reduction="batchmean")
        lo, hi = self.cfg.distill_weight_min, self.cfg.distill_weight_max
        target = (lo + hi) / 2
        task, klv = float(loss.detach()), float(kl.detach())
        total_extra = loss.new_zeros(())
        for d in self.distilling.values():
            if math.isfinite(task) and math.isfinite(klv) and klv > 1e-12 and task > 0:
                # the weight that makes the term `target` of the total, kept in the band
                d.weight = target / (1 - target) * task / klv / len(self.distilling)
            d.share = (d.weight * klv) / (task + len(self.distilling) * d.weight * klv) if task + klv > 0 else 0.0
            total_extra = total_extra + d.weight * kl
        new_loss = loss + total_extra.to(loss.dtype)
        if isinstance(output, dict):
            return {**output, "loss": new_loss}
        output.loss = new_loss
        return output

    # loss side --------------------------------------------------------------------------

    def start_cooling(self, seq: int) -> None:
        self._cool_until = self.seq + self.cfg.lr_cool_steps - 1
        self.engine.job(self.guard.job_id).cooling_until = self._cool_until
        if self._saved_lr is None:
            self._cool()  # this step's update is already cooled

    def _cool(self) -> None:
        opt = self.guard.optimizer
        if opt is None or self._saved_lr is not None:
            return
        self._saved_lr = [g["lr"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] = g["lr"] * self.cfg.lr_cool_factor

    def _uncool(self) -> None:
        opt = self.guard.optimizer
        if opt is not None and self._saved_lr is not None:
            for g, lr in zip(opt.param_groups, self._saved_lr):
                g["lr"] = lr
        self._saved_lr = None

    def _end_cooling(self, why: str) -> None:
        if self._cool_until < 0:
            return
        self._uncool()
        self._cool_until = -1
        self.engine.job(self.guard.job_id).cooling_until = -1
        self.engine.record(Decision("loss_spike", "lr_cool", "none", Target(self.guard.job_id), "cooling",
                                    "cooling_end", why, self.seq, self.clock()), "ended")

    @property
    def cooling(self) -> bool:
        return self._cool_until >= 0

    def schedule_rollback(self, d: Decision) -> None:
        self._pending_rollback = d

    def _rollback(self, d: Decision, step: int) -> None:
        """After the dropped step: restore the last good snapshot and skip the batch."""
        self.skipped_steps.append(step)
        if self.snapshots is None or not hasattr(self.snapshots, "rollback"):
            self.rollbacks.append({"step": step, "to": None})
            self.engine.record(d, "noop", detail="no snapshot engine: the step was dropped, nothing restored")
            return
        try:
            to = int(self.snapshots.rollback(skip_batch=True))
        except Exception as e:  # no snapshot yet, or a corrupt one: the step stays dropped
            self.rollbacks.append({"step": step, "to": None, "error": str(e)})
            self.engine.record(d, "failed", detail=f"rollback: {e}")
            return
        self.rollbacks.append({"step": step, "to": to})
        for m in self.guard.mpus:
            self._fingerprints[m.mpu_id] = self._fingerprint(m)
        self.engine.record(d, "applied", detail=f"restored step {to}, batch of step {step} skipped")
        self.guard.set_step(to + 1)  # the restored state continues at its next step

    def emergency_snapshot(self, d: Decision) -> None:
        """Queue the newest in-memory snapshot for disk now; the writer reports when done."""
        if self.snapshots.latest() is None:
            raise ActionFailed("no in-memory snapshot yet")
        self.emergencies.append(self.snapshots.emergency(why=f"{d.reason} ({d.fault_key})"))

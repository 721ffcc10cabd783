"""A weight changed outside the optimizer (WEIGHT_CORRUPTION, found by the fingerprints of
mscale.hook.weights before the step's forward, or by mscale.hook.weight_check when its MPU's
output failed): put the weights back from the newest trusted in-memory snapshot, exactly.

- That snapshot is of the last completed step (the state the fingerprints were taken of,
  e.g. `memory_every=1`): the corrupted MPUs' parameters and optimizer state are restored
  from it in place, checked against their fingerprints, and the step runs on the repaired
  weights. No step is lost.
- It is older (step S): the corrupted MPUs' parameters are set to S's so this step's forward
  runs on sane weights, its update is dropped, and after it the job rolls back to S (the
  rollback action, which for this reason does not skip a batch: the data was not at fault).
  With a loader that rewinds in place the steps since S re-run on the same batches and the
  run continues bitwise as the fault-free run would have; with one that does not (the
  Trainer's) those steps are undone, not re-run.

The per-job state is the fingerprint watch itself (mscale.hook.weights.WeightWatch): made
when the fuse attaches, checked at each step's begin, re-recorded whenever the weights settle.
It also answers the fuse before it counts an MPU's failing output (`mpu_failed`): the MPU's
weights are checked (mscale.hook.weight_check), and when corrupted they are reported and
repaired here, the MPU's forward re-run on the repaired weights, and the failure not counted.
"""

from __future__ import annotations

from typing import Any

from mscale.healing import actions
from mscale.healing.engine import Decision
from mscale.healing.words import FuseLevel, Result
from mscale.hook.actions.base import ActionFailed, Executor, FuseContext


class Watch:
    """Per job: the fingerprint watch, what each repair did, and the event checks of this step."""

    def __init__(self, fuse) -> None:
        self.watch: Any = None
        self.repairs: list[dict] = []  # {"step", "snapshot", "in_place", "tensors", "mpus"} per repair
        self.source: Any = None  # the snapshot an event check chose for the repair it reports
        self.checked: tuple[int, set[str]] = (-1, set())  # (fuse.seq, MPUs whose weights were checked)
        self.repaired: tuple[int, set[str]] = (-1, set())  # (fuse.seq, MPUs repaired by an event check)
        # mpu_id -> (placement epoch, newest snapshot step) its weights were last found intact at:
        # a fault that persists is not checked again each step until either changes
        self.intact: dict[str, tuple[int, int | None]] = {}

    def attach(self, fuse) -> None:
        from mscale.hook.weights import WeightWatch

        self.watch = WeightWatch(fuse.guard, frozen_every=fuse.cfg.frozen_weights_every, groups=fuse.cfg.weight_groups)

    def step_begin(self, fuse) -> None:
        if self.watch is not None:
            self.watch.check(fuse.guard.current_step)

    def weights_settled(self, fuse) -> None:
        if self.watch is not None:
            self.watch.settle()

    def mpu_failed(self, fuse, m: Any, f: Any) -> bool:
        """MPU `m`'s output failed (the fuse asks before counting it): True when its weights were
        the culprit (found corrupted and repaired now, or earlier in this step, and this is a
        finding of the forward that ran on them: its re-run's findings count)."""
        if self.watch is None:
            return False
        seq = fuse.seq
        repaired = self.repaired[1] if self.repaired[0] == seq else set()
        if m.mpu_id in repaired:
            return getattr(fuse, "_rerunning", None) != m.mpu_id
        return self.check(fuse, m)

    def check(self, fuse, m: Any) -> bool:
        """Check MPU `m`'s weights (mscale.hook.weight_check), once a step; on a corruption report
        it (a weight_corruption finding per tensor: the policy runs the repair) and, inside the
        forward, have the fuse re-run the MPU's forward on the repaired weights. True when repaired."""
        from mscale.hook import weight_check

        seq = fuse.seq
        checked = self.checked[1] if self.checked[0] == seq else set()
        engine = fuse.snapshot_engine
        if m.mpu_id in checked or engine is None:
            return False
        self.checked = (seq, checked | {m.mpu_id})
        held = getattr(engine, "memory_steps", None) or []
        where = (getattr(fuse.placement.get(m.mpu_id), "epoch", 0), max(held) if held else None)
        if self.intact.get(m.mpu_id) == where:
            return False
        verdict = weight_check.check_mpu(fuse, self.watch, m.mpu_id)
        if not verdict.corrupted:
            self.intact[m.mpu_id] = where
            return False
        self.intact.pop(m.mpu_id, None)
        done = len(self.repairs)
        self.source = verdict.snapshot
        self.watch.report(verdict.corrupted, fuse.guard.current_step, why="its output failed")
        self.source = None
        if len(self.repairs) == done:
            return False  # not repaired (no snapshot, healing off): the fuse counts the failure
        self.repaired = (seq, (self.repaired[1] if self.repaired[0] == seq else set()) | {m.mpu_id})
        if fuse.guard._in_step and not fuse.guard.checksum.commit_mode(m):
            fuse.pending_rerun.add(m.mpu_id)  # the output just computed ran on the corrupted weights
        return True


def _restore(guard: Any, snap: Any, names: set[str], *, optimizer: bool) -> int:
    """Copy the parameters `names` (and, with `optimizer`, their optimizer state) back from the
    in-memory snapshot `snap`; returns how many tensors were copied."""
    return snap.copy_back(guard.model, guard.optimizer if optimizer else None, lambda _file, name: name in names)


def _snapshot(fuse: FuseContext, state: Watch, names: set[str]) -> tuple[Any, bool]:
    """The snapshot to restore `names` from (the one an event check chose, else the newest
    trusted: mscale.hook.weight_check) and whether it is of the last completed step (in place)."""
    from mscale.hook import weight_check

    engine = fuse.snapshot_engine
    if engine is None:
        raise ActionFailed("no in-memory snapshot to restore the weights from")
    snap = state.source or weight_check.trusted(engine, sorted(names))
    if snap is None:
        raise ActionFailed("no in-memory snapshot to restore the weights from")
    snap.wait_ready()
    return snap, snap.step == engine.step


def apply(fuse: FuseContext, state: Watch, d: Decision) -> str:
    watch = state.watch
    bad = list(watch.corrupted) if watch is not None else []
    if not bad:
        return Result.NOOP  # found and repaired already (another finding of the same step)
    engine = fuse.snapshot_engine
    mpus = {mpu_id for mpu_id, _ in bad if mpu_id}
    names = {name for mpu_id, name in bad if not mpu_id}
    names |= {name for name, m in watch.owner.items() if m is not None and m.mpu_id in mpus}
    snap, in_place = _snapshot(fuse, state, names)  # in place: it holds what the fingerprints were taken of
    n = _restore(fuse.guard, snap, names, optimizer=in_place)
    if not n:
        raise ActionFailed(f"the in-memory snapshot of step {snap.step} holds none of {sorted(names)[:3]}")
    step = fuse.guard.current_step
    if in_place and not watch.matches():
        # The newest snapshot copies the weights beside the next step (mscale.snapshot.memory),
        # so a weight hit right after the optimizer step can be in its copy: that snapshot holds
        # the corruption (a small change: a large one makes it untrusted before). Restore and
        # roll back to the one before it instead.
        in_place = False
        older = [s for s in engine.memory_steps if s < snap.step]
        prev = engine.latest(max(older)) if older else None
        if prev is None:
            raise ActionFailed(f"the snapshot of step {snap.step} holds the corrupted weights and none is older")
        prev.wait_ready()
        snap = prev
        _restore(fuse.guard, snap, names, optimizer=False)
    state.repairs.append(
        {"step": step, "snapshot": snap.step, "in_place": in_place, "tensors": n, "mpus": sorted(mpus)}
    )
    watch.corrupted = []
    if not in_place:
        why = f"weights of step {snap.step} restored for this step's forward; roll the job back to it"
        rollbacks = fuse.states.get("rollback")
        if rollbacks is not None:
            rollbacks.to_step = snap.step
        result = fuse.run(
            Decision(d.rule, "rollback", FuseLevel.NONE, d.target, d.before, d.reason, why, d.step, fuse.clock())
        )
        if result == Result.FAILED:
            raise ActionFailed(f"the rollback to step {snap.step} failed")
    return Result.APPLIED


def event(state: Watch, d) -> tuple[str, dict[str, str]]:
    if not state.repairs:
        return "", {}
    r = state.repairs[-1]
    what = f"{r['tensors']} tensors of MPU(s) {', '.join(r['mpus']) or '-'}"
    if r["in_place"]:
        return f"{what} restored in place from the snapshot of step {r['snapshot']}: no step lost", {
            "repair": "in_place"
        }
    return (
        f"{what} set to the snapshot of step {r['snapshot']}; the step is dropped and the job rolls back to it",
        {"repair": "rollback"},
    )


EXECUTOR = Executor(actions.get("restore_weights"), apply, state=Watch, event=event)

"""A weight changed outside the optimizer (WEIGHT_CORRUPTION, found by the fingerprints of
mscale.hook.checks.weights before the step's forward, or when its MPU's output went non-finite: below):
put the weights back from the newest trusted in-memory snapshot (mscale.snapshot.trust), exactly.

- That snapshot is of the last completed step (e.g. `memory_every=1`): the corrupted MPUs'
  parameters and optimizer state are restored from it in place, checked against their
  fingerprints; the step runs on the repaired weights, no step lost.
- It is older (step S): the corrupted MPUs' parameters are set to S's so this step's forward
  runs on sane weights, its update is dropped, and after it the job rolls back to S (the
  rollback action, which for this reason does not skip a batch: the data was not at fault).
  With a loader that rewinds in place the steps since S re-run on the same batches and the
  run continues bitwise as the fault-free run would have; with one that does not (the
  Trainer's) those steps are undone, not re-run.

The per-job state is the fingerprint watch itself (mscale.hook.checks.weights.WeightWatch): made
when the fuse attaches, checked at each step's begin, re-recorded whenever the weights settle.
Before the fuse counts an MPU's non-finite output (`mpu_failed`) all the MPU's weights are
checked against the newest trusted snapshot (mscale.snapshot.trust), on the event only; corrupted
ones are repaired here, the MPU's forward re-run on them, the failure not counted.

Each new in-memory snapshot is verified by the snapshot engine on its copier's thread, after
the copy (mscale.snapshot.verify): its optimizer state not poisoned, its weights explained by
optimizer steps since the snapshot before it (mscale.snapshot.trust). A write the rotating
fingerprints did not see (a weight in a group not due, an embedding row no batch has read yet)
and the weights an absurd exp_avg blew up are found there; at the first step end after a
verification completes (when the weights settle) what it found is reported here per tensor,
and restored from the newest snapshot that passes. The training thread reads the verdicts only.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, TypedDict

from mscale.findings import Reason
from mscale.healing import actions
from mscale.healing.engine import Decision
from mscale.healing.words import FuseLevel, Result
from mscale.hook.fuse.actions.base import ActionFailed, Executor, FuseContext

if TYPE_CHECKING:
    from mscale.findings import Finding
    from mscale.hook.checks.weights import WeightWatch
    from mscale.hook.core.mpu import Mpu
    from mscale.snapshot.memory import MemorySnapshot


class Repair(TypedDict):
    """What one repair did (a dict: the benchmarks read it as one)."""

    step: int  # the step it ran in
    snapshot: int  # the step of the snapshot the weights came from
    in_place: bool  # restored in place (no step lost), else the job rolls back to `snapshot`
    tensors: int  # tensors copied back
    mpus: list[str]  # the MPUs whose weights were corrupted


class Watch:
    """Per job: the fingerprint watch, what each repair did, and the event checks of this step."""

    def __init__(self, fuse: FuseContext) -> None:
        self.watch: WeightWatch | None = None
        self.repairs: list[Repair] = []
        self.source: MemorySnapshot | None = None  # the snapshot an event check chose for the repair it reports
        self.seen: dict[str, tuple[int, bool]] = {}  # mpu_id -> (fuse.seq checked at, repaired)
        self.intact: dict[
            str, tuple[int, int | None]
        ] = {}  # mpu_id -> (placement epoch, newest snapshot) found intact at
        self.verified = 0  # the engine's last verification read (mscale.snapshot.verify.Verifier.since)
        self.verify_s, self.verifies = 0.0, 0  # seconds spent reading them on this thread, and how many

    def attach(self, fuse: FuseContext) -> None:
        from mscale.hook.checks.weights import WeightWatch

        self.watch = WeightWatch(fuse.guard, frozen_every=fuse.cfg.frozen_weights_every, groups=fuse.cfg.weight_groups)

    def step_begin(self, fuse: FuseContext) -> None:
        if self.watch is None:
            return
        self.watch.check(fuse.guard.current_step)
        names, self.watch.implausible = self.watch.implausible, []
        for m in fuse.guard.mpus:  # a weight grown beyond any optimizer step: checked as on a failure
            if any(getattr(self.watch.owner.get(n), "mpu_id", None) == m.mpu_id for n in names):
                self.check(fuse, m, why="its largest magnitude grew beyond any optimizer step", rerun=False)

    def verify(self, fuse: FuseContext) -> list[str]:
        """Report the weights that the snapshot verifications completed since the last call
        found (the module docstring); the policy restores them. Returns them."""
        import time

        from mscale.hook.checks.weights import charge
        from mscale.snapshot.keys import wrapper_prefix

        engine, watch = fuse.snapshot_engine, self.watch
        if engine is None or watch is None:
            return []
        verifier = engine.verifier
        t0 = time.perf_counter()
        done = verifier.since(self.verified)
        if not done:
            return []
        self.verified = done[-1][0]
        pre = wrapper_prefix(fuse.guard.model)  # the verdicts name the bare model's parameters
        bad = {pre + n for _, _, v in done for n in v.bad}
        found = [n for n in watch.tensors if n in bad]
        if found:
            step = max(s for _, s, v in done if v.bad)
            watch.report(found, fuse.guard.current_step, why=f"the snapshot of step {step} was verified")
        charge(fuse.guard, "weights", t0)
        self.verify_s, self.verifies = self.verify_s + time.perf_counter() - t0, self.verifies + len(done)
        return found

    def weights_settled(self, fuse: FuseContext) -> None:
        if self.watch is not None:
            self.verify(fuse)  # at the step's end, after its agreement: no read inside a step
            self.watch.settle()

    def mpu_failed(self, fuse: FuseContext, m: Mpu, f: Finding) -> bool:
        """MPU `m`'s output failed: True when its weights, not the device, are the culprit."""
        if self.seen.get(m.mpu_id) == (fuse.seq, True):  # repaired: a finding of the discarded forward
            return getattr(fuse, "_rerunning", None) != m.mpu_id
        return f.reason is Reason.NONFINITE_OUTPUT and self.check(fuse, m)

    def check(self, fuse: FuseContext, m: Mpu, *, why: str = "its output went non-finite", rerun: bool = True) -> bool:
        """Check MPU `m`'s weights (once a step, a placement and a snapshot while intact); report
        corrupted ones (the policy runs `apply`), re-run the forward on them (`rerun`: one ran on
        them already). True when repaired."""
        from mscale.snapshot.trust import unexplained  # an incident's work: not the detection budget's

        engine, watch, held = fuse.snapshot_engine, self.watch, getattr(fuse.snapshot_engine, "memory_steps", [])
        where = (getattr(fuse.placement.get(m.mpu_id), "epoch", 0), max(held) if held else None)
        if (
            engine is None
            or watch is None
            or fuse.seq == self.seen.get(m.mpu_id, (-1,))[0]
            or self.intact.get(m.mpu_id) == where
        ):
            return False
        self.seen[m.mpu_id] = (fuse.seq, False)
        live = {n: t for n, t in watch.tensors.items() if getattr(watch.owner.get(n), "mpu_id", None) == m.mpu_id}
        bad, self.source = unexplained(live, set(watch.names["frozen"]), engine)
        self.intact[m.mpu_id], done = where, len(self.repairs)
        if bad:
            del self.intact[m.mpu_id]
            watch.report(bad, fuse.guard.current_step, why=why)
        self.source = None
        if len(self.repairs) == done:
            return False  # intact, or not repaired (no snapshot, healing off): the fuse counts it
        self.seen[m.mpu_id] = (fuse.seq, True)
        if rerun and fuse.guard.step_state.in_step and not fuse.guard.checksum.commit_mode(m):
            fuse.pending_rerun.add(m.mpu_id)  # the output just computed ran on the corrupted weights
        return True


def _restore(fuse: FuseContext, snap: MemorySnapshot, names: set[str], *, optimizer: bool) -> int:
    """Copy the parameters `names` (and, with `optimizer`, their optimizer state) back from the
    in-memory snapshot `snap`; returns how many tensors were copied. Under FSDP2 into the
    engine's model, whose tensors are this rank's shards (mscale/snapshot/sharded.py)."""
    from mscale.snapshot.sharded import is_sharded

    guard, engine = fuse.guard, fuse.snapshot_engine
    model, opt = guard.model, guard.optimizer
    if engine is not None and is_sharded(guard.model):
        model, opt = getattr(engine, "model", model), getattr(engine, "optimizer", opt)
    return snap.copy_back(model, opt if optimizer else None, lambda _file, name: name in names)


def apply(fuse: FuseContext, state: Watch, d: Decision) -> str:
    from mscale.snapshot import trust

    watch = state.watch
    if watch is None or not watch.corrupted:
        return Result.NOOP  # found and repaired already (another finding of the same step)
    engine = fuse.snapshot_engine
    bad = list(watch.corrupted)
    mpus = {mpu_id for mpu_id, _ in bad if mpu_id}
    names = {name for mpu_id, name in bad if not mpu_id}
    names |= {name for name, m in watch.owner.items() if m is not None and m.mpu_id in mpus}
    snap = state.source or (trust.trusted(engine, sorted(names)) if engine is not None else None)
    if snap is None or engine is None:
        raise ActionFailed("no in-memory snapshot to restore the weights from")
    snap.wait_ready()
    in_place = snap.step == engine.step  # the snapshot holds the state the fingerprints were taken of
    n = _restore(fuse, snap, names, optimizer=in_place)
    if not n:
        raise ActionFailed(f"the in-memory snapshot of step {snap.step} holds none of {sorted(names)[:3]}")
    step = fuse.guard.current_step
    if in_place and not watch.matches():
        # The newest snapshot copies the weights beside the next step (mscale.snapshot.memory),
        # so a weight hit right after the optimizer step can be in its copy: that snapshot holds
        # the corruption (a small one: see trust.trusted). Roll back to the one before it instead.
        in_place = False
        older = [s for s in engine.memory_steps if s < snap.step]
        prev = engine.latest(max(older)) if older else None
        if prev is None:
            raise ActionFailed(f"the snapshot of step {snap.step} holds the corrupted weights and none is older")
        prev.wait_ready()
        snap = prev
        _restore(fuse, snap, names, optimizer=False)
    state.repairs.append(
        {"step": step, "snapshot": snap.step, "in_place": in_place, "tensors": n, "mpus": sorted(mpus)}
    )
    watch.corrupted = []
    if not in_place:
        why = f"weights of step {snap.step} restored for this step's forward; roll the job back to it"
        from mscale.hook.fuse.actions.rollback import Rollbacks

        rollbacks = fuse.state_of(Rollbacks)
        if rollbacks is not None:
            rollbacks.to_step = snap.step
        result = fuse.run(replace(d, action="rollback", level=FuseLevel.NONE, why=why, time=fuse.clock()))
        if result == Result.FAILED:
            raise ActionFailed(f"the rollback to step {snap.step} failed")
    return Result.APPLIED


def event(state: Watch, d: Decision) -> tuple[str, dict[str, str]]:
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

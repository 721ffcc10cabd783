"""NaN/Inf loss or a persisting spike: drop this step's update (its gradients never reach the
weights), then, after the step, roll back to the last good in-memory snapshot and skip the
offending batch (not for a weight corrupted between steps: the batch was not at fault, and the
steps since the snapshot re-run on the same batches). Without a snapshot engine the step is
still dropped, and the event says so. With several ranks the restore is the engine's
collective `agree_rollback`, run at every step end on every rank (mscale.hook.core.agree): all ranks
restore the same step, or none does, and the batch is stepped over unless every rollback
asked keeps it (the agreement counts those pending before it; the ones decided after it,
on agreed values, are alike on every rank): on each rank, the micro-batches whose loss was
not finite there (under gradient accumulation the clean ones of the step re-run), all of the
step's where that rank asked for the rollback and no loss names one, none on a rank whose
losses were all finite and that did not ask (its batch was not at fault)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NotRequired, TypedDict

import structlog

from mscale.healing import actions
from mscale.healing.engine import Decision
from mscale.healing.progress import COMMIT_FAILURE
from mscale.healing.words import Result
from mscale.hook.fuse.actions.base import Executor, FuseContext

if TYPE_CHECKING:
    from mscale.snapshot.engine import SnapshotEngine

log = structlog.get_logger("mscale.fuse")
_REFUSED = "no rollback (its fault rolled back once already, or past the progress bound: docs/healing.md)"

# reasons whose batch is re-run, not skipped: the batch was not at fault (commit_failure: the
# checks found a fault at the commit point, mscale.hook.fuse.fuse.FusePlugin.rerun_step)
KEEP_BATCH = ("weight_corruption", "gradient_corruption", COMMIT_FAILURE)
LOSS_NONFINITE = "loss_nonfinite"
# reasons whose weights are not at fault (the step's update was dropped, the weights are what
# they were at its start): the step is run again from its start (the snapshot engine's step
# mark: data, RNG, scheduler put back), not rolled back to an older snapshot
REWIND = ("gradient_corruption", COMMIT_FAILURE)
# reasons whose weights are known bad: the rollback runs whatever it costs (the cost is charged)
WEIGHTS_BAD = ("weight_corruption",)


class Rolled(TypedDict):
    """What one rollback did (a dict: the demo, the tests and the benchmarks read it as one)."""

    step: int  # the step whose update was dropped
    to: int | None  # the step restored (None: none was)
    error: NotRequired[str]  # why the restore failed
    refused: NotRequired[int]  # the steps it would have cost past the progress bound (none was run)
    rewind: NotRequired[bool]  # the step was run again from its start, not rolled back


class Rollbacks:
    """Per job: the decision whose rollback runs after this step, and what each one did."""

    def __init__(self, fuse: FuseContext) -> None:
        self.pending: Decision | None = None  # until the step ends
        self.rollbacks: list[Rolled] = []
        self.skipped_steps: list[int] = []
        self.to_step: int | None = None  # the next rollback's target when an action chose one, else the newest
        self.handled_seq = -1  # the fuse's step run whose fault was handled already (its batch skipped)

    def detach(self, fuse: FuseContext) -> None:
        if self.pending is not None:  # the step never ended: its one event says so
            d, self.pending = self.pending, None
            fuse.record(d, Result.FAILED, detail="the guard detached before the step ended: nothing restored")

    def settle(self, fuse: FuseContext, step: int) -> bool:
        engine = fuse.snapshot_engine
        if engine is not None and engine.world_size > 1:
            return self._agree(fuse, engine, step)
        if self.pending is None:
            return False
        d, self.pending = self.pending, None
        if d.reason in REWIND and self.to_step is None and _rewind(fuse, self, d, step):
            return True
        return self._rollback(fuse, d, step)  # True: the step's state was replaced (not snapshotted)

    def _agree(self, fuse: FuseContext, engine: SnapshotEngine, step: int) -> bool:
        """Several ranks: all ranks restore the same step or none does, whichever rank asked.
        When the step agreement ran for this step (mscale.hook.core.agree), the ranks already know:
        a rollback pending before it is in its count, and one decided after it was decided on
        the agreed loss and norms, alike on every rank; so no further collective, unless there
        is a fault (the newest step every rank holds). Otherwise the engine's collective commit
        point, on every rank at every step end, as SnapshotPlugin does."""
        d, self.pending = self.pending, None
        agreement = getattr(fuse.guard, "agreement", None)
        last = agreement.history[-1] if agreement is not None and agreement.history else None
        skip = True
        agreed = last is not None and last.step == step and not last.rollback
        if d is not None and d.reason in REWIND and agreed and _rewind(fuse, self, d, step):
            # agreed (every rank re-runs the step alike, none had a rollback pending before it):
            # each rank rewinds its own step mark, no collective
            return True
        if last is not None and last.step == step and (d is not None or last.rollback):
            # the ledger is fed agreed values on every rank: every rank refuses alike
            held = engine.held_steps
            cost = step - held[-1] if held else 1
            if not fuse.progress.rollback_fits(cost, held[-1] if held else None):
                fuse.progress.charge(1)
                self.skipped_steps.append(step)
                self.rollbacks.append({"step": step, "to": None, "refused": cost})
                if d is not None:
                    fuse.record(d, Result.APPLIED, detail=f"{_dropped(step)}, its batch skipped: {_REFUSED}")
                return False
        try:
            if last is not None and last.step == step:
                # the batch is kept when every rollback asked for keeps it: those pending before
                # the agreement are in its count, those decided after were decided alike everywhere
                skip = (d is not None and d.reason not in KEEP_BATCH) or last.rollback > last.keep
                to = _to_newest_common(engine, *_mine(fuse, d, skip)) if d is not None or last.rollback else None
            else:
                skip_batch, micro_batches = _mine(fuse, d)
                to = engine.agree_rollback(d is not None, skip_batch=skip_batch, micro_batches=micro_batches)
        except Exception as e:  # no snapshot common to every rank: the step stays dropped everywhere
            self.skipped_steps.append(step)
            self.rollbacks.append({"step": step, "to": None, "error": str(e)})
            if d is not None:
                fuse.record(d, Result.FAILED, detail=f"{_dropped(step)}; rollback: {e}")
            return True
        if to is None:
            if d is not None:
                fuse.record(d, Result.NOOP, detail=f"{_dropped(step)}, no rank rolled back")
            return False
        if skip:
            self.skipped_steps.append(step)
        self.rollbacks.append({"step": step, "to": int(to)})
        fuse.progress.charge(step - int(to), rollback=True)
        fuse.dispatch("weights_settled")
        if d is not None:
            done = _skipped(engine, step) if skip else f"the batches of step {step} re-run with the steps since"
            fuse.record(d, Result.APPLIED, detail=f"{_dropped(step)}, restored step {to} on every rank, {done}")
        fuse.guard.set_step(int(to) + 1)
        return True

    def _rollback(self, fuse: FuseContext, d: Decision, step: int) -> bool:
        skip = d.reason not in KEEP_BATCH
        engine = fuse.snapshot_engine
        if engine is None or not hasattr(engine, "rollback"):
            self.skipped_steps.append(step)
            self.rollbacks.append({"step": step, "to": None})
            fuse.record(d, Result.NOOP, detail=f"{_dropped(step)}; no snapshot engine: nothing restored")
            return True
        to_step, self.to_step = self.to_step, None
        if to_step is None:
            to_step = sound_step(engine)  # past a snapshot of poisoned optimizer state, if the newest is one
        held = [s for s in getattr(engine, "held_steps", []) if to_step is None or s == to_step]
        cost = step - held[-1] if held else 1
        forced = to_step is not None or d.reason in WEIGHTS_BAD  # the weights are bad: restore them
        if not forced and not fuse.progress.rollback_fits(cost, held[-1] if held else None):
            # the fault's event rolled back once already, or this one would cost past its bound:
            # the step's update stays dropped and the loop goes on with the next batch
            fuse.progress.charge(1)
            self.skipped_steps.append(step)
            self.rollbacks.append({"step": step, "to": None, "refused": cost})
            fuse.record(d, Result.APPLIED, detail=f"{_dropped(step)}, its batch skipped: {_REFUSED} ({cost} steps)")
            return False
        fuse.progress.charge(cost, rollback=True)
        if fuse.progress.stopping is not None:
            return True
        if skip:
            self.skipped_steps.append(step)
        try:
            to = int(engine.rollback(to_step, skip_batch=skip, micro_batches=_bad(fuse) if skip else ()))
        except Exception as e:  # no snapshot yet, or a corrupt one: the step stays dropped
            self.rollbacks.append({"step": step, "to": None, "error": str(e)})
            fuse.record(d, Result.FAILED, detail=f"{_dropped(step)}; rollback: {e}")
            return True
        self.rollbacks.append({"step": step, "to": to})
        fuse.dispatch("weights_settled")
        kept = _skipped(engine, step) if skip else f"the batches of step {step} re-run with the steps since"
        fuse.record(d, Result.APPLIED, detail=f"{_dropped(step)}, restored step {to}, {kept}")
        fuse.guard.set_step(to + 1)  # the restored state continues at its next step
        return True


def _rewind(fuse: FuseContext, state: Rollbacks, d: Decision, step: int) -> bool:
    """The step run again from its start on its batch (see REWIND); False: no step mark of the
    step before (the caller rolls back instead). Its cost was charged when it was asked for."""
    engine = fuse.snapshot_engine
    if engine is None or not hasattr(engine, "rewind"):
        return False
    try:
        engine.rewind(step - 1)
    except Exception as e:  # no mark (a step after a restore the engine did not see): roll back
        log.info("rewind_unavailable", step=step, error=str(e))
        return False
    state.rollbacks.append({"step": step, "to": step - 1, "rewind": True})
    rewound = (
        "data position, RNG and scheduler"
        if getattr(engine.data, "rewinds", True)
        else "RNG and scheduler (the loader cannot rewind: the next batch)"
    )
    fuse.record(
        d,
        Result.APPLIED,
        detail=f"{_dropped(step)}, step {step} re-run from its start ({rewound} rewound, weights kept)",
    )
    fuse.guard.set_step(step)
    return True


def _dropped(step: int) -> str:
    return f"the update of step {step} dropped"


def _bad(fuse: FuseContext) -> list[int]:
    """The step's micro-batches whose loss was not finite: the ones a rollback steps over."""
    inputs = getattr(fuse.guard, "inputs", None)  # mscale.hook.checks.inputs.InputCheck
    return inputs.nonfinite_micro_batches() if inputs is not None else []


def _mine(fuse: FuseContext, d: Decision | None, skip: bool = True) -> tuple[bool, list[int]]:
    """This rank's part of a rollback every rank makes (skip_batch, micro_batches): when the
    batch is stepped over (`skip`), the micro-batches whose loss was not finite here; none when
    every loss here was finite and another rank asked, or the agreed loss was not finite (then
    another rank's was: this rank's batch was not at fault, its micro-batches re-run); every
    micro-batch of the step otherwise (this rank asked, and no loss says which)."""
    if not skip:
        return False, []
    bad = _bad(fuse)
    if bad:
        return True, bad
    # a non-finite loss agreed while every loss here was finite: another rank's micro-batch
    return (d is not None and d.reason != LOSS_NONFINITE), []


def _skipped(engine: SnapshotEngine, step: int) -> str:
    """What the rollback stepped over, for its event: the micro-batches of the step, by position."""
    skipped = list(getattr(engine, "last_skipped", None) or [])
    if not skipped:
        return f"the batch of step {step} skipped (the loop had moved past it)"
    where = "; ".join(", ".join(f"{k} {v}" for k, v in p.items()) for p in skipped)
    return f"{len(skipped)} micro-batch{'es' if len(skipped) > 1 else ''} of step {step} skipped ({where})"


def _to_newest_common(engine: SnapshotEngine, skip: bool = True, micro_batches: Sequence[int] = ()) -> int:
    """Every rank, once the ranks agree there is a fault: restore the newest in-memory snapshot
    every rank holds (one gather of the steps held), the faulty batch skipped (`skip`: the
    `micro_batches` of it, all when none is named) or re-run."""
    from mscale.snapshot import distributed as mdist  # torch: job side only

    target = mdist.newest_common(engine.held_steps, engine.group)
    if target is None:
        raise RuntimeError("no in-memory snapshot common to every rank: no rank rolls back")
    return engine.rollback(target, skip_batch=skip, micro_batches=micro_batches)


def sound_step(engine: SnapshotEngine) -> int | None:
    """None when the newest in-memory snapshot's optimizer state is sound (mscale.snapshot.trust:
    restoring it is the plain rollback), else the step of the newest trusted one (-1: none is,
    which no rollback finds: the step stays dropped, the progress bound counts it)."""
    from mscale.snapshot import trust

    latest = getattr(engine, "latest", None)
    newest = latest() if callable(latest) else None
    if newest is None or not hasattr(newest, "tensors"):
        return None
    newest.wait_ready()
    if not trust.state_bad(newest, trust.moment_bound(getattr(engine, "optimizer", None))):
        return None
    model = getattr(engine, "model", None)
    snap = trust.trusted(engine, [n for n, _ in model.named_parameters()] if model is not None else [])
    return -1 if snap is None else int(snap.step)


def apply(fuse: FuseContext, state: Rollbacks, d: Decision) -> str:
    fuse.drop_step(f"{d.reason}: rollback")
    if state.handled_seq == fuse.seq:
        # the step failed at the commit point, ran again and failed again: its batch is skipped
        # already (mscale.healing.progress); what follows from the same fault (a non-finite loss)
        # does not roll back on top of it
        return Result.NOOP
    first = state.pending
    if first is not None and first.reason == COMMIT_FAILURE and first.step == d.step and d.reason != COMMIT_FAILURE:
        # the step already re-runs on its batch for a fault the checks found at the commit point
        # (on every rank alike, before the loss statistics): what follows from it in the same
        # step, a non-finite loss from the faulty output, does not make the batch skipped
        return Result.NOOP
    state.pending = d
    return Result.DEFERRED  # one event per rollback: the restore after the step books it, with the drop


EXECUTOR = Executor(actions.get("rollback"), apply, state=Rollbacks)

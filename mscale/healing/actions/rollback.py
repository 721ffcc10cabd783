"""NaN/Inf loss or a persisting spike: drop this step's update (its gradients never reach the
weights), then, after the step, roll back to the last good in-memory snapshot and skip the
offending batch (not for a weight corrupted between steps: the batch was not at fault, and the
steps since the snapshot re-run on the same batches). Without a snapshot engine the step is
still dropped, and the event says so."""

from __future__ import annotations

from typing import Any

from mscale.healing.actions.base import ActionSpec

KEEP_BATCH = ("weight_corruption",)  # reasons whose batch is re-run, not skipped


class Rollbacks:
    """Per job: the decision whose rollback runs after this step, and what each one did."""

    def __init__(self, fuse) -> None:
        self.pending: Any = None  # the Decision, until the step ends
        self.rollbacks: list[dict] = []  # {"step", "to" (restored step or None), ["error"]} per rollback
        self.skipped_steps: list[int] = []

    def settle(self, fuse, step: int) -> bool:
        if self.pending is None:
            return False
        d, self.pending = self.pending, None
        self._rollback(fuse, d, step)
        return True  # the step's state was dropped or replaced: not snapshotted

    def _rollback(self, fuse, d, step: int) -> None:
        skip = d.reason not in KEEP_BATCH
        if skip:
            self.skipped_steps.append(step)
        engine = fuse.snapshot_engine
        if engine is None or not hasattr(engine, "rollback"):
            self.rollbacks.append({"step": step, "to": None})
            fuse.engine.record(d, "noop", detail="no snapshot engine: the step was dropped, nothing restored")
            return
        try:
            to = int(engine.rollback(skip_batch=skip))
        except Exception as e:  # no snapshot yet, or a corrupt one: the step stays dropped
            self.rollbacks.append({"step": step, "to": None, "error": str(e)})
            fuse.engine.record(d, "failed", detail=f"rollback: {e}")
            return
        self.rollbacks.append({"step": step, "to": to})
        fuse.dispatch("weights_settled")
        kept = "skipped" if skip else "re-run with the steps since"
        fuse.engine.record(d, "applied", detail=f"restored step {to}, batch of step {step} {kept}")
        fuse.guard.set_step(to + 1)  # the restored state continues at its next step


def apply(fuse, state: Rollbacks, d) -> str:
    fuse.drop_step(f"{d.reason}: rollback")
    state.pending = d
    return "step_dropped"  # the restore after the step books "applied" (or why not)


ACTION = ActionSpec(
    "rollback",
    "none",
    None,
    apply,
    "drop the step, restore the last good snapshot, skip the batch",
    scope="job",
    state=Rollbacks,
)

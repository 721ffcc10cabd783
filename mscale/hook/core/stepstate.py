"""The guard's step, as two typed objects it owns: `StepState`, what the step in progress has
gathered and asked for (its losses, its findings, a skip or a re-run), and `StepFigures`, what
the step's statistics measured (what `Guard.summary()` and the step report carry)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from mscale.findings import Finding


@dataclass
class StepState:
    """The step in progress. `losses` is one list for the guard's life: the input check and the
    commit point hold it and change it in place (never rebind it)."""

    in_step: bool = False
    skip_reason: str = ""  # this step's update is dropped (Guard.request_skip)
    rerun_reason: str = ""  # a fault found at the commit point: the step is re-run (request_rerun)
    committed: int = -1  # the step whose commit point was read
    step_set: bool = False  # set_step() ran in this step: the guard runs that step next
    losses: list[torch.Tensor | float] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)  # made since the last report

    def begin(self) -> None:
        """A step starts: no skip, no re-run, its commit point not read yet (a step re-run
        after a rollback commits again). Findings made between steps stay queued."""
        self.in_step = True
        self.skip_reason = self.rerun_reason = ""
        self.committed = -1


@dataclass
class StepFigures:
    """A step's figures: its statistics (mscale.hook.checks.stepstats) and, once the step has
    ended, the checksum budget's per-MPU figures and the guard's overhead ratio."""

    step: int
    time: float
    loss: float | None
    grad_norm: float | None
    clipped: dict[str, bool] = field(default_factory=dict)
    checksum: dict[str, dict[str, float]] | None = None
    guard_overhead_ratio: float | None = None

    def summary(self) -> dict[str, object]:
        """The figures as `Guard.summary()` returns them: the end-of-step ones once there."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for late in ("checksum", "guard_overhead_ratio"):
            if out[late] is None:
                del out[late]
        return out

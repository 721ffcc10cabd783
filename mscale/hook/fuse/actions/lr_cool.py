"""Loss spike: multiply the learning rate by `healing.lr_cool_factor` for
`healing.lr_cool_steps` steps, then restore it. Applied to each step's update inside the
window and undone right after it, so an LR scheduler keeps its own schedule. While the window
is open the job's policy level is "cooling" (a spike that persists rolls back); the window
ends after its steps, or early when the agent sends an end command (its alert resolved)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mscale.healing import actions
from mscale.healing.engine import Decision, Target
from mscale.healing.words import FuseLevel, Result
from mscale.hook.fuse.actions.base import ActionFailed, Executor, FuseContext

if TYPE_CHECKING:
    import torch

NAME = "lr_cool"


class Cooling:
    """Per job: the window (in steps run, `fuse.seq`, which a rollback does not set back) and
    the learning rates saved while one step's update is cooled."""

    def __init__(self, fuse: FuseContext) -> None:
        self.factor: float = fuse.cfg.lr_cool_factor
        self.steps: int = fuse.cfg.lr_cool_steps
        self.until = -1  # last seq of the window (-1: closed)
        self.rule = ""  # the rule that opened it
        self.saved_lr: list[float] | None = None

    def step_begin(self, fuse: FuseContext) -> None:
        if self.until >= fuse.seq:
            self.cool(fuse.guard.optimizer)

    def step_end(self, fuse: FuseContext, step: int) -> None:
        if self.saved_lr is not None:
            self.uncool(fuse.guard.optimizer)
        if self.until >= 0 and fuse.seq >= self.until:
            end(fuse, self, "window over")

    def cool(self, opt: torch.optim.Optimizer | None) -> None:
        if opt is None or self.saved_lr is not None:
            return
        self.saved_lr = [g["lr"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] = g["lr"] * self.factor

    def uncool(self, opt: torch.optim.Optimizer | None) -> None:
        if opt is not None and self.saved_lr is not None:
            for g, lr in zip(opt.param_groups, self.saved_lr, strict=False):
                g["lr"] = lr
        self.saved_lr = None


def apply(fuse: FuseContext, state: Cooling, d: Decision) -> str:
    if fuse.guard.optimizer is None:
        raise ActionFailed("no optimizer attached")
    state.until = fuse.seq + state.steps - 1
    state.rule = d.rule
    state.cool(fuse.guard.optimizer)  # this step's update is already cooled
    return Result.APPLIED


def end(fuse: FuseContext, state: Cooling, why: str) -> None:
    """Close the window: restore the LR, book "ended" (the job is healthy again)."""
    if state.until < 0:
        return
    state.uncool(fuse.guard.optimizer)
    state.until = -1
    fuse.record(
        Decision(
            rule=state.rule,
            action=NAME,
            level=FuseLevel.NONE,
            target=Target(fuse.guard.job_id),
            before="cooling",
            reason="cooling_end",
            why=why,
            step=fuse.guard.current_step,
            time=fuse.clock(),
        ),
        Result.ENDED,
    )


EXECUTOR = Executor(actions.get("lr_cool"), apply, state=Cooling, end=end)

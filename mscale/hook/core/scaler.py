"""The guard's steps under a GradScaler (fp16 AMP): a step whose `optimizer.step()` the scaler
skipped still ends, at `scaler.update()`. A part the guard (mscale.hook.core.guard.Guard) holds,
kept apart because it is the one path that ends a step outside the optimizer's hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class ScalerWatch:
    """The GradScaler the guard watches: `update()` patched on the instance to call
    `on_update(stepped)` after it (stepped: optimizer.step() ran since the last update)."""

    def __init__(self, on_update: Callable[[bool], None]) -> None:
        self.on_update = on_update
        self.scaler: torch.amp.GradScaler | None = None  # the watched one (or a subclass): its update() ends steps
        self._patch: Callable[..., None] | None = None
        self.used = False  # the loop calls scaler.update(): steps end there
        self.opt_stepped = False  # optimizer.step() ran in this step

    @property
    def ends_steps(self) -> bool:
        """Steps end at the scaler's update, not at the optimizer step."""
        return self.scaler is not None and self.used

    def watch(self, scaler: torch.amp.GradScaler) -> None:
        """End each step at `scaler.update()` (called once per iteration after `scaler.step`),
        so a step whose `optimizer.step()` the scaler skipped still ends: the loss detector sees
        its loss, plugins get `on_step_end` (a NaN rollback), the report says skipped. Snapshots
        taken at the step end then hold the scale as updated for that step. Until the loop first
        calls `scaler.update()`, steps still end at the optimizer step."""
        if scaler is self.scaler:
            return
        if self.scaler is not None:
            raise ValueError("the guard already watches another GradScaler")
        self.used = False
        original: Callable[..., None] = scaler.update  # called with the loop's arguments

        def update(*args: object, **kwargs: object) -> None:
            original(*args, **kwargs)
            self._updated()

        # on the instance; unwatch() deletes it, uncovering the class's
        scaler.update = update  # type: ignore[method-assign]
        self.scaler, self._patch = scaler, update

    def unwatch(self) -> None:
        if self.scaler is not None:
            if self.scaler.__dict__.get("update") is self._patch:
                del self.scaler.update
            self.scaler = None

    def _updated(self) -> None:
        stepped, self.opt_stepped = self.opt_stepped, False
        # From now on steps end here. (Not before: a scaler held only to be snapshotted, in a
        # loop that never calls it, must not leave every step open.)
        self.used = True
        self.on_update(stepped)

"""The guard's steps under a GradScaler (fp16 AMP): a step whose `optimizer.step()` the scaler
skipped still ends, at `scaler.update()`. A part of mscale.hook.core.guard.Guard (its base class),
kept apart because it is the one path that ends a step outside the optimizer's hooks."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any


class ScalerSteps:
    """Mixed into Guard: uses its step state (`_in_step`, `_skip_reason`, `mpus`, `loss_detector`,
    `_end_step`, ...)."""

    _scaler: Any
    _scaler_patch: Any
    _scaler_used: bool
    _opt_stepped: bool
    # the Guard's, which this part reads
    _in_step: bool
    _skip_reason: str
    _last: Any
    mpus: Any
    loss_detector: Any
    log: Any

    if TYPE_CHECKING:
        current_step: int

        def emit(self, finding: Any) -> None: ...
        def _step_loss(self) -> float | None: ...
        def _end_step(self) -> None: ...

    def watch_scaler(self, scaler: Any) -> None:
        """End each step at `scaler.update()` (called once per iteration after `scaler.step`),
        so a step whose `optimizer.step()` the scaler skipped still ends: the loss detector sees
        its loss, plugins get `on_step_end` (a NaN rollback), the report says skipped. Snapshots
        taken at the step end then hold the scale as updated for that step. Until the loop first
        calls `scaler.update()`, steps still end at the optimizer step."""
        if scaler is self._scaler:
            return
        if self._scaler is not None:
            raise ValueError("the guard already watches another GradScaler")
        self._scaler_used = False
        original = scaler.update

        def update(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            self._scaler_update()
            return result

        scaler.update = update  # on the instance; detach() deletes it, uncovering the class's
        self._scaler, self._scaler_patch = scaler, update

    def _scaler_update(self) -> None:
        stepped, self._opt_stepped = self._opt_stepped, False
        # From now on steps end here. (Not before: a scaler held only to be snapshotted, in a
        # loop that never calls it, must not leave every step open.)
        self._scaler_used = True
        if not self._in_step:
            return
        if not stepped:
            self._scaler_skipped()
        self._end_step()

    def _scaler_skipped(self) -> None:
        """The scaler found inf/NaN gradients and skipped optimizer.step(). Only the loss goes
        to the detector: inf gradients with a finite loss are the scaler's ordinary overflow
        (it lowers the scale), not a fault to roll back; a NaN loss is one."""
        self._skip_reason = self._skip_reason or "grad scaler: inf/NaN gradients, optimizer step skipped"
        for m in self.mpus:
            m.grad_norm = m.gvc = math.nan
        loss = self._step_loss()
        try:
            for f in self.loss_detector.observe(self.current_step, loss):
                self.emit(f)
        except Exception as e:
            self.log.exception("guard_error", where="scaler_skip", error=str(e))
        self._last = {
            "step": self.current_step,
            "time": time.time(),
            "loss": loss,
            "grad_norm": math.nan,
            "clipped": {},
        }

"""The step's gradient and loss statistics at the guard's commit (the optimizer step pre-hook):
gradient norms and CMSA's GVC (mscale.hook.checks.cmsa), the step's mean loss, the non-finite check that
keeps a NaN from the weights, the loss detector and CMSA's clipping. A part the guard
(mscale.hook.core.guard.Guard) holds and calls, kept apart because it is one thing the step does
at one point: read the gradients and the loss once and act on them."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import structlog
import torch
from torch import nn

from mscale.findings import Finding
from mscale.hook.checks.budget import StepTimes
from mscale.hook.checks.cmsa import GVC_EVERY, Cmsa, GradStatistics
from mscale.hook.checks.loss import LossDetector
from mscale.hook.core.mpu import Mpu
from mscale.hook.core.stepstate import StepFigures, StepState


class StepStatistics:
    """Measures the guard's step: `measure` at the optimizer step, `scaler_skipped` for a step
    whose optimizer step a GradScaler skipped. Each returns the step's figures; a non-finite
    loss or gradient norm sets the step state's skip reason (the update is dropped)."""

    def __init__(
        self,
        *,
        mpus: Sequence[Mpu],
        optimizer: torch.optim.Optimizer | None,
        model: nn.Module,
        cmsa: Cmsa | None,
        loss_detector: LossDetector,
        grad_stats: GradStatistics,
        times: StepTimes,
        state: StepState,
        emit: Callable[[Finding], None],
        log: structlog.typing.FilteringBoundLogger,
    ) -> None:
        self.mpus, self.optimizer, self.model, self.cmsa = mpus, optimizer, model, cmsa
        self.loss_detector, self.grad_stats, self.times = loss_detector, grad_stats, times
        self.state, self.emit, self.log = state, emit, log

    def measure(self, step: int) -> StepFigures:
        for m in self.mpus:
            if m._bwd_start and m._bwd_end >= m._bwd_start:
                m.backward_s = m._bwd_end - m._bwd_start
        t0 = time.perf_counter()
        params = (
            [p for g in self.optimizer.param_groups for p in g["params"]]
            if self.optimizer
            else [p for p in self.model.parameters()]
        )
        scheduled = self.cmsa.wants_gvc(step) if self.cmsa is not None else step % GVC_EVERY == 0
        global_norm = self.grad_stats.measure(self.mpus, params, step, scheduled)
        loss = step_loss(self.state.losses)
        if self.optimizer is not None and not self.state.skip_reason:
            bad = [
                what
                for what, v in (("loss", loss), ("gradient norm", global_norm))
                if v is not None and not math.isfinite(v)
            ]
            if bad:  # never let it reach the weights, with or without a plugin that reacts
                self.state.skip_reason = f"non-finite {' and '.join(bad)}"
        t1 = time.perf_counter()
        self.times.grad_stats_s += t1 - t0
        for f in self.loss_detector.observe(step, loss, global_norm, {m.mpu_id: m.grad_norm for m in self.mpus}):
            self.emit(self._blamed(f))
        t2 = time.perf_counter()
        self.times.loss_s += t2 - t1
        clipped: dict[str, bool] = {}
        if self.cmsa is not None and not self.state.skip_reason:
            clipped = self.cmsa.apply(step, loss)
        self.times.cmsa_s += time.perf_counter() - t2
        return StepFigures(step=step, time=time.time(), loss=loss, grad_norm=global_norm, clipped=clipped)

    def _blamed(self, f: Finding) -> Finding:
        """An MPU's gradient-norm jump or spike names the tensor that carries the largest
        gradient norm in that MPU (a `tensor` label): the norms taken again on the event only,
        one `_foreach_norm`, nothing per step. A non-finite norm names none (a NaN spreads to
        every gradient before it)."""
        mpu_id, level = f.labels.get("mpu_id"), f.labels.get("level")
        if f.labels.get("series") != "mpu_grad_norm" or level not in ("jump", "action", "warn"):
            return f
        mpu = next((m for m in self.mpus if m.mpu_id == mpu_id), None)
        ps = [p for p in mpu.parameters() if p.grad is not None] if mpu is not None else []
        if not ps:
            return f
        with torch.no_grad():
            norms = torch._foreach_norm([p.grad.detach() for p in ps if p.grad is not None], 2)
            top = ps[int(torch.stack([n.to(torch.float32) for n in norms]).argmax())]
        name = next((n for n, p in self.model.named_parameters() if p is top), None)
        if name is None:
            return f
        return Finding(f.source, f.reason, f.severity, f"{f.message} (largest: {name})", {**f.labels, "tensor": name})

    def measure_safe(self, step: int, where: str) -> StepFigures | None:
        """`measure`, or None (logged) when it raised: a detector bug must not stop training."""
        try:
            return self.measure(step)
        except Exception as e:
            self.log.exception("guard_error", where=where, error=str(e))
            return None

    def scaler_skipped(self, step: int) -> StepFigures:
        """The scaler found inf/NaN gradients and skipped optimizer.step(). Only the loss goes
        to the detector: inf gradients with a finite loss are the scaler's ordinary overflow
        (it lowers the scale), not a fault to roll back; a NaN loss is one."""
        state = self.state
        state.skip_reason = state.skip_reason or "grad scaler: inf/NaN gradients, optimizer step skipped"
        for m in self.mpus:
            m.grad_norm = m.gvc = math.nan
        loss = step_loss(state.losses)
        try:
            for f in self.loss_detector.observe(step, loss):
                self.emit(f)
        except Exception as e:
            self.log.exception("guard_error", where="scaler_skip", error=str(e))
        return StepFigures(step=step, time=time.time(), loss=loss, grad_norm=math.nan, clipped={})


def step_loss(losses: Sequence[torch.Tensor | float]) -> float | None:
    """The step's mean loss over its forwards (None: none seen)."""
    if not losses:
        return None
    if len(losses) == 1:
        return float(losses[0])
    if all(isinstance(v, float) for v in losses):  # read at the commit point
        return math.fsum(float(v) for v in losses) / len(losses)
    # several forwards (gradient accumulation): one read-back for all their losses
    vals = [v if isinstance(v, torch.Tensor) else torch.tensor(float(v)) for v in losses]
    if len({v.device for v in vals}) == 1:
        return torch.stack([v.reshape(()).to(torch.float64) for v in vals]).mean().item()
    return sum(float(v) for v in vals) / len(vals)

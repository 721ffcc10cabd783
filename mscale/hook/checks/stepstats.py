"""The step's gradient and loss statistics at the guard's commit (the optimizer step pre-hook):
gradient norms and CMSA's GVC (mscale.hook.checks.cmsa), the step's mean loss, the non-finite check that
keeps a NaN from the weights, the loss detector and CMSA's clipping. A part of
mscale.hook.core.guard.Guard (a base class, as mscale.hook.core.scaler is), kept apart because it is one
thing the step does at one point: read the gradients and the loss once and act on them."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch

from mscale.findings import Finding
from mscale.hook.checks.cmsa import GVC_EVERY


class StepStatistics:
    """Mixed into Guard: uses its step state (`mpus`, `optimizer`, `model`, `cmsa`, `_losses`,
    `_skip_reason`, `times`, `loss_detector`, `_grad_stats`, `_last`, ...)."""

    mpus: Any
    optimizer: Any
    model: Any
    cmsa: Any
    loss_detector: Any
    times: Any
    log: Any
    current_step: int
    _losses: list
    _skip_reason: str
    _grad_stats: Any
    _last: dict

    if TYPE_CHECKING:

        def emit(self, finding: Any) -> None: ...

    def _statistics(self) -> None:
        for m in self.mpus:
            if m._bwd_start and m._bwd_end >= m._bwd_start:
                m.backward_s = m._bwd_end - m._bwd_start
        t0 = time.perf_counter()
        params = (
            [p for g in self.optimizer.param_groups for p in g["params"]]
            if self.optimizer
            else [p for p in self.model.parameters()]
        )
        step = self.current_step
        scheduled = self.cmsa.wants_gvc(step) if self.cmsa is not None else step % GVC_EVERY == 0
        global_norm = self._grad_stats.measure(self.mpus, params, step, scheduled)
        loss = self._step_loss()
        if self.optimizer is not None and not self._skip_reason:
            bad = [
                what
                for what, v in (("loss", loss), ("gradient norm", global_norm))
                if v is not None and not math.isfinite(v)
            ]
            if bad:  # never let it reach the weights, with or without a plugin that reacts
                self._skip_reason = f"non-finite {' and '.join(bad)}"
        t1 = time.perf_counter()
        self.times.grad_stats_s += t1 - t0
        for f in self.loss_detector.observe(
            self.current_step, loss, global_norm, {m.mpu_id: m.grad_norm for m in self.mpus}
        ):
            self.emit(self._blamed(f))
        t2 = time.perf_counter()
        self.times.loss_s += t2 - t1
        clipped: dict[str, bool] = {}
        if self.cmsa is not None and not self._skip_reason:
            clipped = self.cmsa.apply(self.current_step, loss)
        self.times.cmsa_s += time.perf_counter() - t2
        self._last = {
            "step": self.current_step,
            "time": time.time(),
            "loss": loss,
            "grad_norm": global_norm,
            "clipped": clipped,
        }

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
            norms = torch._foreach_norm([p.grad.detach() for p in ps], 2)
            top = ps[int(torch.stack([n.to(torch.float32) for n in norms]).argmax())]
        name = next((n for n, p in self.model.named_parameters() if p is top), None)
        if name is None:
            return f
        return Finding(f.source, f.reason, f.severity, f"{f.message} (largest: {name})", {**f.labels, "tensor": name})

    def _statistics_safe(self) -> None:
        try:
            self._statistics()
        except Exception as e:
            self.log.exception("guard_error", where="end_step", error=str(e))

    def _step_loss(self) -> float | None:
        if not self._losses:
            return None
        if len(self._losses) == 1:
            return float(self._losses[0])
        if all(isinstance(v, float) for v in self._losses):  # read at the commit point
            return math.fsum(self._losses) / len(self._losses)
        # several forwards (gradient accumulation): one read-back for all their losses
        vals = [v if isinstance(v, torch.Tensor) else torch.tensor(float(v)) for v in self._losses]
        if len({v.device for v in vals}) == 1:
            return torch.stack([v.reshape(()).to(torch.float64) for v in vals]).mean().item()
        return sum(float(v) for v in vals) / len(vals)

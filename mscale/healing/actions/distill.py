"""L3 cross-modal distillation: the MPU keeps failing even degraded.

A KL term between the detached text-MPU hidden state and the projected output of the failing
MPU is added to the loss, weighted so that it is `healing.distill_weight_min`..`max` of the
total (adapted every step), until the MPU recovers; then it is removed. The text MPU itself
cannot be distilled from itself: for it the action fails.

The term is added by a forward hook on the model, registered when the fuse attaches (after the
guard's own model hook: the loss detector watches the task loss, backward gets the task loss
plus the L3 term, a step up by design, not a spike).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mscale.healing.actions.base import ActionFailed, ActionSpec
from mscale.healing.fsm import Level


@dataclass
class Distill:
    """L3 state of one MPU: the KL weight, adapted so the term is a fixed share of the loss."""

    mpu_id: str
    weight: float = 0.0
    share: float = 0.0  # the KL term's share of the total loss at the last step


class Distilling:
    """Per job: the MPUs being distilled, this step's captured outputs, the shares per step."""

    def __init__(self, fuse) -> None:
        self.band = (fuse.cfg.distill_weight_min, fuse.cfg.distill_weight_max)
        self.mpus: dict[str, Distill] = {}
        self.shares: list[tuple[int, str, float, float]] = []  # (step, mpu_id, share of loss, weight)
        self._captured: dict[str, Any] = {}
        self._handle: Any = None

    def attach(self, fuse) -> None:
        self._handle = fuse.guard.model.register_forward_hook(self._model_output)

    def detach(self, fuse) -> None:
        self.mpus.clear()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def step_begin(self, fuse) -> None:
        self._captured = {}

    def step_end(self, fuse, step: int) -> None:
        for d in self.mpus.values():
            self.shares.append((step, d.mpu_id, d.share, d.weight))

    def in_force(self, fuse, m: Any) -> bool:
        return m.mpu_id in self.mpus

    def undo(self, fuse, m: Any) -> None:
        self.mpus.pop(m.mpu_id, None)

    def mpu_output(self, fuse, mpu: Any, output: Any) -> None:
        import torch

        if not self.mpus or mpu.name not in ("aligner", "text"):
            return
        t = output[1] if mpu.name == "text" and isinstance(output, tuple) and len(output) > 1 else output
        t = getattr(t, "last_hidden_state", t)
        if isinstance(t, (tuple, list)):
            t = t[0]
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            self._captured[mpu.name] = t

    def _model_output(self, module: Any, args: tuple, output: Any) -> Any:
        """Add the KL term to the loss the model returns (before backward sees it)."""
        import torch
        from torch.nn import functional as F

        if not self.mpus or not module.training:
            return None
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        proj, text = self._captured.get("aligner"), self._captured.get("text")
        if not isinstance(loss, torch.Tensor) or proj is None or text is None:
            return None
        student = proj.float().mean(dim=1)  # (B, H): the failing MPU's output as the text model receives it
        teacher = (
            text[:, proj.shape[1] :].detach().float().mean(dim=1)
            if text.shape[1] > proj.shape[1]
            else text.detach().float().mean(dim=1)
        )
        if student.shape != teacher.shape:
            return None
        kl = F.kl_div(
            F.log_softmax(student, dim=-1), F.log_softmax(teacher, dim=-1), log_target=True, reduction="batchmean"
        )
        lo, hi = self.band
        target = (lo + hi) / 2
        task, klv = float(loss.detach()), float(kl.detach())
        total_extra = loss.new_zeros(())
        n = len(self.mpus)
        for d in self.mpus.values():
            if math.isfinite(task) and math.isfinite(klv) and klv > 1e-12 and task > 0:
                # the weight that makes the term `target` of the total, kept in the band
                d.weight = target / (1 - target) * task / klv / n
            d.share = (d.weight * klv) / (task + n * d.weight * klv) if task + klv > 0 else 0.0
            total_extra = total_extra + d.weight * kl
        new_loss = loss + total_extra.to(loss.dtype)
        if isinstance(output, dict):
            return {**output, "loss": new_loss}
        output.loss = new_loss
        return output


def apply(fuse, state: Distilling, d) -> str:
    m = fuse.guard.mpu(d.target.mpu_id)
    if m.name == "text":
        raise ActionFailed("the text MPU is the teacher; nothing to distill from")
    state.mpus.setdefault(m.mpu_id, Distill(m.mpu_id))
    return "applied"


ACTION = ActionSpec(
    "l3_distill",
    "L3",
    Level.L3_DISTILLING,
    apply,
    "distill the failing MPU from the text MPU",
    scope="mpu",
    new_placement=True,
    state=Distilling,
)

"""L3 cross-modal distillation: the MPU keeps failing even degraded.

The term (mscale.hook.fuse.distill.Term: the failing MPU's output as the text model receives it,
against the text MPU's detached hidden states) is added to the loss the model returns until
the MPU recovers, then removed with any projection it made. No term for a model (no text MPU,
the text MPU itself failing, no way to place the student): L3 is not applied, its event says
why, and the MPU stays at L2.

The weight aims at the middle of `healing.distill_weight_min`..`max` of the total loss, set from
the task-loss / term ratio of the step before (the first L3 step calibrates on its own); the share
each step took is measured on its own values (`shares`, the Mpu's `distill_share`), so a ratio
that moves fast shows as a share out of the band.

The term is added by a forward hook on the model, after the guard's own (the loss detector
watches the task loss; backward gets the total). The output keeps its type: its `loss` replaced
in place, `task_loss` beside it. The step report carries both (`mscale_job_loss`,
`mscale_job_task_loss`); outside L3 they are equal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import structlog
from torch import nn

from mscale.healing import actions
from mscale.healing.engine import Decision
from mscale.healing.words import Result
from mscale.hook.fuse.actions.base import ActionFailed, Executor, FuseContext
from mscale.link import StepReport

if TYPE_CHECKING:
    import torch
    from torch.utils.hooks import RemovableHandle

    from mscale.hook.core.mpu import Mpu
    from mscale.hook.fuse.distill import Captured, Projection, Term

log = structlog.get_logger("mscale.fuse")

SNAPSHOT_NAME = "fuse_l3"
SMOOTH = 1.0  # weight of the newest step in the average the next weight comes from (1: the last step alone)


@dataclass
class Distill:
    """L3 state of one MPU."""

    mpu_id: str
    term: Term
    weight: float | None = None  # None until the first L3 step calibrates it
    next_weight: float | None = None  # from this step's ratio, used at the next step
    share: float = 0.0  # the term's share of the total loss at the last step (measured)
    why_not: str = ""  # why the term could not be added at the last step ("" when it was)


class Held(TypedDict):
    """One MPU's L3 state as a snapshot holds it (`Distilling.state_dict`)."""

    projection: Projection | None  # None: the term needs none
    weight: float | None
    next_weight: float | None


class Distilling:
    """Per job: the MPUs being distilled, the tensors captured for the term, the shares per step.
    Snapshotted with the job (the snapshot engine's `extra`, as `SNAPSHOT_NAME`): the projections
    made at L3 entry, their optimizers' state and the next step's weight, so a rollback while at
    L3 continues as the run it returns to would have."""

    snapshot_optional = True  # a snapshot from before this state existed restores as "none made"

    def __init__(self, fuse: FuseContext) -> None:
        self.band = (fuse.cfg.distill_weight_min, fuse.cfg.distill_weight_max)
        self.mpus: dict[str, Distill] = {}
        # (step, mpu_id, share of the total loss, weight, calibration step?)
        self.shares: list[tuple[int, str, float, float, bool]] = []
        self._captured: Captured | None = None
        self._last: Captured | None = None  # the previous complete step's capture (L3 entry checks the term on it)
        self._handles: list[RemovableHandle] = []
        self._calibrating: set[str] = set()
        self._terms: list[float] = []  # this step's L3 term value per training forward (0: none added)
        # the guard's replay check is running (not the step's forward)
        self._replaying: Callable[[], bool] = lambda: False
        # MPUs L3 cannot be applied to, and why: said once each (`_say_unavailable`)
        self.unavailable: dict[str, str] = {}
        self._checked: set[str] = set()

    def attach(self, fuse: FuseContext) -> None:
        from mscale.hook.fuse.distill import Captured, lm_head_of

        self._captured = Captured()
        extra = getattr(fuse.snapshot_engine, "extra", None)
        if isinstance(extra, dict):
            extra.setdefault(SNAPSHOT_NAME, self)
        import torch

        # on the module the loop calls, never traced: a torch.compile wrapper runs them outside
        # its graph, a model compiled after attach at the graph's entry and exit (as the guard's)
        model = fuse.guard.outer
        text = next((m for m in fuse.guard.mpus if m.name == "text"), None)
        pre, post = torch._dynamo.disable(self._model_input), torch._dynamo.disable(self._model_output)
        self._handles.append(model.register_forward_pre_hook(pre, with_kwargs=True))
        self._handles.append(model.register_forward_hook(post))
        if text is not None:
            self._handles.append(text.module.register_forward_pre_hook(self._text_input, with_kwargs=True))
            head = lm_head_of(text.module)
            if head is not None:  # a text model with a head: its hidden states are the head's input
                self._replaying = lambda: bool(getattr(fuse.guard.checksum, "replaying", False))
                self._handles.append(head.register_forward_pre_hook(self._text_hidden))
        self._checked = {m.mpu_id for m in fuse.guard.mpus if m.name == "text"}  # the teacher
        self._say_unavailable(fuse, None)  # what the layout alone rules out

    def detach(self, fuse: FuseContext) -> None:
        extra = getattr(fuse.snapshot_engine, "extra", None)
        if isinstance(extra, dict) and extra.get(SNAPSHOT_NAME) is self:
            del extra[SNAPSHOT_NAME]
        for d in self.mpus.values():
            d.term.close()
        self.mpus.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def report(self, fuse: FuseContext, report: StepReport) -> None:
        """The step report's `loss` is what the model returned: the task loss plus the term."""
        task = report.task_loss
        if self._terms and task is not None and math.isfinite(task):
            report.loss = task + sum(self._terms) / len(self._terms)

    def step_begin(self, fuse: FuseContext) -> None:
        from mscale.hook.fuse.distill import Captured

        self._terms = []
        self._captured = Captured()

    def step_end(self, fuse: FuseContext, step: int) -> None:
        for d in self.mpus.values():
            d.term.step()
            if d.weight is not None and not d.why_not:
                self.shares.append((step, d.mpu_id, d.share, d.weight, d.mpu_id in self._calibrating))
            m = fuse.guard.mpu(d.mpu_id)
            m.distill_share = d.share
        self._calibrating.clear()
        if len(self._checked) < len(fuse.guard.mpus):
            self._say_unavailable(fuse, self._captured)
        # an L3 entry builds its term on this step's tensors first (the MPU outputs, the text
        # model's hidden states among them, stay alive one step longer for it)
        self._last = self._captured

    def _say_unavailable(self, fuse: FuseContext, cap: Captured | None) -> None:
        """Say once per MPU that L3 cannot be applied to it, and why: at attach what the layout rules
        out, at the end of the first step it ran what its placement does (docs/healing.md)."""
        import torch

        from mscale.hook.fuse.distill import Term

        guard = fuse.guard
        texts = [m.mpu_id for m in guard.mpus if m.name == "text"]
        for m in guard.mpus:
            if m.mpu_id in self._checked:
                continue
            ran = cap is not None and {m.mpu_id, *texts} <= {mpu_id for mpu_id, _ in cap.calls}  # and the teacher
            compiled = cap is not None and not cap.calls and guard.outer is not guard.model
            if cap is not None and not ran and not compiled:
                continue
            term = Term(guard.model, guard.mpus, m)
            try:
                why = term.why_not()
                if not why and compiled:
                    why = "the model is compiled: the MPUs' outputs stay inside its graph, where the term cannot read them"
                elif not why and ran and cap is not None:
                    with torch.no_grad():
                        why = term.loss(cap)[1]
            finally:
                term.close()
            if why or cap is not None:
                self._checked.add(m.mpu_id)
            if why:
                self.unavailable[m.mpu_id] = why
                log.warning("l3_unavailable", mpu_id=m.mpu_id, mpu=m.name, why=why)

    def in_force(self, fuse: FuseContext, m: Mpu) -> bool:
        return m.mpu_id in self.mpus

    def state_dict(self) -> dict[str, Held]:
        """What a snapshot holds: per MPU at L3, its projection (None when it needs none) and weights."""
        return {
            mpu_id: {"projection": d.term.state(), "weight": d.weight, "next_weight": d.next_weight}
            for mpu_id, d in self.mpus.items()
        }

    def load_state_dict(self, state: Mapping[str, Held] | None) -> None:
        """A rollback: each MPU still at L3 gets its projection and weights back as the snapshot
        held them; one the snapshot predates, its projection as made and a weight to calibrate
        again. MPUs the snapshot held that are no longer at L3 stay recovered (the fuse's levels
        are not rolled back)."""
        state = state or {}
        for mpu_id, d in self.mpus.items():
            held = state.get(mpu_id)
            d.term.restore(held["projection"] if held else None)
            d.weight, d.next_weight = (held["weight"], held["next_weight"]) if held else (None, None)

    def undo(self, fuse: FuseContext, m: Mpu) -> None:
        d = self.mpus.pop(m.mpu_id, None)
        if d is not None:
            d.term.close()
        m.distill_share = 0.0

    def mpu_output(self, fuse: FuseContext, mpu: Mpu, output: object) -> None:
        if self._captured is not None:
            self._captured.outputs[mpu.mpu_id] = output
            self._captured.calls.append((mpu.mpu_id, output))

    def _model_input(self, module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        import torch

        if module.training and self._captured is not None:
            self._captured.calls.clear()  # the MPU calls of this forward (accumulation: the last forward's)
            if args and isinstance(args[0], Mapping) and "input_ids" not in kwargs:
                kwargs = {**args[0], **kwargs}  # a wrapper called with the batch as one dict (`self(batch)`)
            ids = kwargs.get("input_ids", args[0] if args else None)
            self._captured.input_ids = ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
            mask = kwargs.get("attention_mask")
            self._captured.attention_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    def _text_input(self, module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        if module.training and self._captured is not None:
            self._captured.text_inputs, self._captured.text_kwargs = args, kwargs

    def _text_hidden(self, module: nn.Module, args: tuple[object, ...]) -> None:
        """The text MPU's LM head's input (its final hidden states): the teacher. A replay's
        forward is the check's, not the step's; a re-run's replaces the discarded one."""
        from mscale.hook.integrations.compiled import compiling

        if module.training and args and self._captured is not None and not compiling() and not self._replaying():
            self._captured.hidden = args[0]

    def _model_output(self, module: nn.Module, args: tuple[object, ...], output: object) -> object:
        """Add the term to the loss the model returns (before backward sees it). A hook on the
        model itself, outside the guard's plugin calls: an error here would reach the training
        loop, so it is logged and the step goes on with the task loss alone."""
        try:
            return self._add_term(module, output)
        except Exception as e:
            log.exception("distill_term_error", error=str(e))
            for d in self.mpus.values():
                d.why_not = f"{type(e).__name__}: {e}"
            return None

    def _add_term(self, module: nn.Module, output: object) -> object:
        import torch

        if not self.mpus or not module.training or self._captured is None:
            return None
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            return None
        task = float(loss.detach())
        self._terms.append(0.0)
        lo, hi = self.band
        target = (lo + hi) / 2
        terms: list[tuple[Distill, float, torch.Tensor, float]] = []  # (state, weight, term, its value)
        for d in self.mpus.values():
            kl, d.why_not = d.term.loss(self._captured)
            if kl is None:
                continue
            k = float(kl.detach())
            if not (math.isfinite(task) and math.isfinite(k) and k > 1e-12 and task > 0):
                d.why_not = f"task loss {task:.3g}, term {k:.3g}: no weight"
                continue
            solved = target / (1 - target) * task / k / len(self.mpus)
            previous = d.next_weight
            if d.weight is None or previous is None:
                previous = solved  # the first L3 step calibrates on itself (booked as such)
                self._calibrating.add(d.mpu_id)
            d.weight = w = previous
            # geometric moving average of the solved weights (SMOOTH 1: the last step's alone)
            d.next_weight = (
                math.exp(SMOOTH * math.log(solved) + (1 - SMOOTH) * math.log(previous))
                if solved > 0 and previous > 0
                else solved
            )
            terms.append((d, w, kl, k))
        if not terms:
            return None
        extra = sum(w * k for _, w, _, k in terms)
        self._terms[-1] = extra
        for d, w, _, k in terms:
            d.share = w * k / (task + extra)
        total = terms[0][1] * terms[0][2]
        for _, w, kl, _ in terms[1:]:
            total = total + w * kl
        new_loss = loss + total.to(loss.dtype)
        if isinstance(output, dict):
            output["loss"] = new_loss  # in place: the output keeps its type
            output["task_loss"] = loss  # the task loss alone, beside the total (also the guard's `loss`)
        else:  # an output object with a `loss` attribute (read above): the same two, by name
            setattr(output, "loss", new_loss)  # noqa: B010
            setattr(output, "task_loss", loss)  # noqa: B010
        return output


def apply(fuse: FuseContext, state: Distilling, d: Decision) -> str:
    import torch

    from mscale.hook.fuse.distill import Term

    m = fuse.guard.mpu(d.target.mpu_id)
    if m.mpu_id in state.mpus:
        return Result.NOOP
    term = Term(fuse.guard.model, fuse.guard.mpus, m)
    why = term.why_not()
    last = state._last
    if not why and last is None:
        why = "no complete step yet to build the term on"
    if not why and last is not None:  # the term, built on the last complete step: "applied" means it exists
        with torch.no_grad():
            _, why = term.loss(last)
    if why:
        term.close()
        raise ActionFailed(f"no distillation term for this model: {why}")
    state.mpus[m.mpu_id] = Distill(m.mpu_id, term)
    return Result.APPLIED


def event(state: Distilling, d: Decision) -> tuple[str, dict[str, str]]:
    dist = state.mpus.get(d.target.mpu_id)
    if dist is None:
        return "", {}
    t = dist.term
    via = f"through {t.carrier.name}" if t.carrier is not t.failing else "its own output"
    where = t.layout or "image-token positions"
    lo, hi = state.band
    return f"contrastive to the text MPU's hidden states, student {via}, at the {where}; share {lo:g}-{hi:g}", {}


EXECUTOR = Executor(actions.get("l3_distill"), apply, state=Distilling, event=event)

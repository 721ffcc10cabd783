"""The guard inside PyTorch Lightning, as a callback.

    trainer = lightning.Trainer(max_steps=1000, accumulate_grad_batches=4, precision="bf16-mixed",
                                callbacks=[mscale.lightning.MscaleCallback(job_id="run-42", snapshots=True)])

The arguments are the Hugging Face callback's (mscale/hook/integrations/hf.py): `job_id`, `snapshots`, and the
other keyword arguments of `mscale.attach` except what Lightning owns (`data`, `scheduler`,
`resume`). `setup` checks the stage and the module; the guard attaches at `on_train_start`,
once Lightning has built the optimizers (after `setup`) and restored a checkpoint, to the
LightningModule and its one torch optimizer; its MPUs are found under the module's attributes as
usual (`model.model.vision_tower` for a LLaVA held as `self.model`). `training_step` must run the
module's own forward (`self(**batch)`), whose output carries the loss: that is where each step
begins and where the loss comes from (a step without it is refused with what to do).

Lightning runs the forward and backward inside `optimizer.step(closure)`, and torch calls an
optimizer's step hooks around that whole call: the guard's commit point would come before the
gradients exist. The callback therefore runs the closure first and then the optimizer's step, as
Lightning's own precision plugins do for a GradScaler, so the commit point sees the step's
gradients. With `accumulate_grad_batches` the optimizer steps once per N batches: a guard step is
that real step and covers its N forwards. `precision="bf16-mixed"` is autocast (no scaler).

With `snapshots`, a faulty step (NaN loss or gradient, a weight changed between steps) rolls the
model, the optimizer and every LR scheduler back to the newest in-memory snapshot, and Lightning's
loop goes back to the snapshot's step + 1 (its optimizer-step counter, so `max_steps`, the
schedulers' step-wise updates and logging follow); Lightning's data loader is not rewound, so the
undone steps are re-run on the batches that follow the faulty one (`memory_every=1` undoes only
that step). Restarts go through Lightning's own checkpoints (`ckpt_path`): a snapshot directory
that already holds snapshots is refused, as under the Hugging Face Trainer. CMSA's fitted state
(mscale.hook.checks.cmsa.CmsaState) rides in those checkpoints as the callback's state, so that a
restarted run clips as the uninterrupted one did (a checkpoint without it: CMSA starts afresh).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Unpack

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from mscale.findings import Finding, Reason
from mscale.hook.checks.cmsa import CmsaState
from mscale.hook.core.attach import attach
from mscale.hook.core.guard import Guard
from mscale.hook.core.null import NullGuard
from mscale.hook.core.protect import snapshot_config
from mscale.hook.integrations.callbacks import protect_attached, refuse_owned

if TYPE_CHECKING:
    from mscale.hook.core.options import CallbackOptions
    from mscale.snapshot.config import SnapshotConfig

__all__ = ["MscaleCallback"]

_LIGHTNING_OWNS = {
    "data": "Lightning's data loader",
    "scheduler": "the LightningModule's LR schedulers (all of them are snapshotted)",
    "resume": "ckpt_path",
}


class MscaleCallback(Callback):
    def __init__(
        self,
        *,
        job_id: str,
        snapshots: str | os.PathLike[str] | bool | SnapshotConfig | None = None,
        **attach_kwargs: Unpack[CallbackOptions],
    ) -> None:
        refuse_owned(attach_kwargs, _LIGHTNING_OWNS, under="Lightning", owner="Lightning's")
        self.job_id = job_id
        self.snapshot_config = snapshot_config(snapshots)  # refused here, before training starts
        self.attach_kwargs = attach_kwargs
        self.guard: Guard | NullGuard | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._step_before: Callable[..., object] | None = None  # the optimizer's own `step` instance attribute, if any
        self._forward_seen = False
        self._restored_cmsa: dict[str, object] | None = None  # from Lightning's checkpoint, for the guard to come

    # --- Lightning's hooks ---------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and not pl_module.automatic_optimization:
            raise ValueError(
                "MscaleCallback: manual optimization (automatic_optimization=False) is not supported: "
                "use mscale.attach on the module and its optimizer in your training_step's loop"
            )

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"MscaleCallback: expected one optimizer, the module configures {len(trainer.optimizers)}")
        optimizer = trainer.optimizers[0]
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("MscaleCallback: LBFGS evaluates its closure many times a step: not supported")
        self.attach_kwargs.setdefault("rank", trainer.global_rank)
        plugins = [*self.attach_kwargs.pop("plugins", ()), _StepWatch(self)]
        options: CallbackOptions = {**self.attach_kwargs, "plugins": plugins}
        guard = self.guard = attach(pl_module, optimizer, job_id=self.job_id, **options)
        if not isinstance(guard, Guard):
            return
        guard.set_step(trainer.global_step)
        if self._restored_cmsa is not None:  # before protect: its first snapshot holds it too
            CmsaState(guard.cmsa, guard._grad_stats).load_state_dict(self._restored_cmsa)
        self._closure_first(optimizer)
        if self.snapshot_config is not None:  # after set_step: the first snapshot is of the step before
            protect_attached(
                guard, self.snapshot_config, self.attach_kwargs, scheduler=_Schedulers(trainer), on_failure=self._detach
            )

    def state_dict(self) -> dict[str, object]:
        """What Lightning's checkpoints hold of the callback: CMSA's fitted state."""
        guard = self.guard
        return {"cmsa": CmsaState(guard.cmsa, guard._grad_stats).state_dict()} if isinstance(guard, Guard) else {}

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        cmsa = state_dict.get("cmsa")  # (a checkpoint from before CMSA's state was held: none)
        self._restored_cmsa = cmsa if isinstance(cmsa, dict) else None

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: object) -> None:
        if isinstance(self.guard, Guard) and not self._forward_seen:
            raise RuntimeError(
                "MscaleCallback: the LightningModule's forward did not run in this step: call self(...) "
                "in training_step (the guard begins each step there and reads the loss from its output)"
            )

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: object, batch: object, i: int
    ) -> None:
        # after a rollback the guard's step is the truth: Lightning's loop goes back to it
        guard = self.guard
        # (mid-accumulation both count the steps completed, so they agree)
        if isinstance(guard, Guard) and guard.current_step != trainer.global_step:
            _set_optimizer_steps(trainer, guard.current_step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._detach()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._detach()

    # --- helpers ---------------------------------------------------------------------------

    def _closure_first(self, optimizer: torch.optim.Optimizer) -> None:
        """optimizer.step(closure) runs the closure (forward, backward) and then the step with its
        hooks, so the guard's commit point comes after the gradients."""
        stepped: Callable[..., object] = optimizer.step  # bound, or an LR scheduler's wrapper around it
        self._optimizer, self._step_before = optimizer, optimizer.__dict__.get("step")

        def step(closure: Callable[[], object] | None = None, **kwargs: object) -> object:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            stepped(**kwargs)
            return loss

        if hasattr(stepped, "_wrapped_by_lr_sched"):  # the LR scheduler's check that step() is still its wrapper
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        optimizer.step = step  # type: ignore[method-assign,assignment]  # an instance attribute, removed at detach

    def _detach(self) -> None:
        if self._optimizer is not None:
            if self._step_before is not None:
                self._optimizer.step = self._step_before  # type: ignore[method-assign,assignment]
            else:
                del self._optimizer.step
            self._optimizer = None
        if self.guard is not None:
            self.guard.detach()


class _StepWatch:
    """A guard plugin: whether the module's forward began the step in progress."""

    def __init__(self, callback: MscaleCallback) -> None:
        self.callback = callback

    def on_step_begin(self, step: int, batch: object) -> None:
        self.callback._forward_seen = True

    def on_step_end(self, step: int, loss: object) -> None:
        self.callback._forward_seen = False

    def on_finding(self, finding: Finding) -> None:
        if finding.reason is Reason.ROLLBACK:
            self.callback._forward_seen = False


class _Schedulers:
    """Every LR scheduler of the Trainer, as the one object the snapshots hold."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, object]:
        return {"schedulers": [c.scheduler.state_dict() for c in self.trainer.lr_scheduler_configs]}

    def load_state_dict(self, state: dict[str, object]) -> None:
        configs, held = self.trainer.lr_scheduler_configs, state["schedulers"]
        if not isinstance(held, list) or len(held) != len(configs):
            n = len(held) if isinstance(held, list) else type(held).__name__
            raise ValueError(f"snapshot holds {n} LR schedulers, the Trainer has {len(configs)}")
        for config, sd in zip(configs, held, strict=True):
            config.scheduler.load_state_dict(sd)


def _set_optimizer_steps(trainer: Trainer, steps: int) -> None:
    """Lightning's optimizer-step counter (trainer.global_step) set to `steps`."""
    progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step
    progress.total.ready = progress.total.completed = steps

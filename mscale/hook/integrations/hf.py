"""The guard inside the Hugging Face Trainer, as a callback.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[mscale.MscaleCallback(job_id="run-42", snapshots="/ckpt/run-42")])

At `on_train_begin` it attaches a Guard to the Trainer's model and to the torch optimizer
inside the Trainer's (Accelerate-wrapped) optimizer; MPUs are found under `model.` as usual.
Steps then ride on `optimizer.step()` like in a plain loop, the loss comes from the model's
output, and the guard's step counter follows `state.global_step`. `on_train_end` detaches
(finishing queued snapshot writes). Other keyword arguments are those of `mscale.attach`.

Without `snapshots`, a step with a non-finite loss or gradient has its update dropped. With
`snapshots` (a directory, True for in memory only, or a `mscale.SnapshotConfig`, as for
`mscale.attach`) the fuse and the snapshot engine come too, and such a step rolls the model and
the optimizer back to the newest in-memory snapshot. The Trainer owns the rest and keeps it: its
step counter, its LR scheduler (which follows that counter) and its data loader, which goes on
with the batch after the faulty one; so the faulty batch is passed over and the steps since the
snapshot are undone, not re-run (`SnapshotConfig(memory_every=1)` makes that none). A weight
changed between steps is found before the next forward and restored from the snapshot; with
`memory_every=1` in place, exactly, with no step lost (see docs/healing.md). Restarts go
through the Trainer's own checkpoints (`resume_from_checkpoint`): a snapshot directory that
already holds snapshots is refused (give each run its own).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Unpack

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from mscale.hook.core.attach import attach
from mscale.hook.core.guard import Guard
from mscale.hook.core.null import NullGuard
from mscale.hook.core.protect import snapshot_config
from mscale.hook.integrations.callbacks import protect_attached, refuse_owned

if TYPE_CHECKING:
    from mscale.hook.core.options import CallbackOptions
    from mscale.snapshot.config import SnapshotConfig

_TRAINER_OWNS = {
    "data": "the Trainer's data loader",
    "scheduler": "the Trainer's LR scheduler",
    "resume": "resume_from_checkpoint",
}


class MscaleCallback(TrainerCallback):
    def __init__(
        self,
        *,
        job_id: str,
        snapshots: str | os.PathLike[str] | bool | SnapshotConfig | None = None,
        **attach_kwargs: Unpack[CallbackOptions],
    ) -> None:
        refuse_owned(attach_kwargs, _TRAINER_OWNS, under="the Trainer", owner="the Trainer's")
        self.job_id = job_id
        self.snapshot_config = snapshot_config(snapshots)  # refused here, before training starts
        self.attach_kwargs = attach_kwargs
        self.guard: Guard | NullGuard | None = None

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: object,
    ) -> TrainerControl:
        if model is None:
            raise ValueError("MscaleCallback: the Trainer passed no model to on_train_begin")
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        self.attach_kwargs.setdefault("rank", getattr(args, "process_index", 0))
        guard = self.guard = attach(model, inner, job_id=self.job_id, **self.attach_kwargs)
        if isinstance(guard, Guard):
            guard.set_step(state.global_step)
            if self.snapshot_config is not None:  # after set_step: the first snapshot is of the step before
                protect_attached(guard, self.snapshot_config, self.attach_kwargs, on_failure=guard.detach)
        return control

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> TrainerControl:
        # the Trainer's step counter is the truth (resumes, skipped steps, rollbacks)
        if isinstance(self.guard, Guard) and self.guard.current_step != state.global_step:
            self.guard.set_step(state.global_step)
        return control

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> TrainerControl:
        if self.guard is not None:
            self.guard.detach()
        return control

"""The guard inside the Hugging Face Trainer, as a callback.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[mscale.MscaleCallback(job_id="run-42")])

At `on_train_begin` it attaches a Guard to the Trainer's model and to the torch optimizer
inside the Trainer's (Accelerate-wrapped) optimizer; MPUs are found under `model.` as usual.
Steps then ride on `optimizer.step()` like in a plain loop, the loss comes from the model's
output, and the guard's step counter follows `state.global_step`. `on_train_end` detaches.
Keyword arguments are those of `mscale.attach`.
"""
from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from mscale.hook.guard import Guard, NullGuard, attach


class MscaleCallback(TrainerCallback):
    def __init__(self, *, job_id: str, **attach_kwargs: Any) -> None:
        self.job_id = job_id
        self.attach_kwargs = attach_kwargs
        self.guard: Guard | NullGuard | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None:
            raise ValueError("MscaleCallback: the Trainer passed no model to on_train_begin")
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        self.attach_kwargs.setdefault("rank", getattr(args, "process_index", 0))
        self.guard = attach(model, inner, job_id=self.job_id, **self.attach_kwargs)
        if isinstance(self.guard, Guard):
            self.guard.set_step(state.global_step)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        # the Trainer's step counter is the truth (resumes, skipped steps)
        if isinstance(self.guard, Guard) and self.guard.current_step != state.global_step:
            self.guard.set_step(state.global_step)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.guard is not None:
            self.guard.detach()
        return control

"""The guard under Hugging Face Accelerate, on what `accelerator.prepare` returns.

    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    guard = mscale.accelerate.attach(accelerator, model, optimizer, job_id="run-42",
                                     snapshots="/ckpt/run-42", data=loader, scheduler=scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step(); optimizer.zero_grad()

A helper rather than plain `mscale.attach`, because each of these is a thing the user would
otherwise have to know about Accelerate's wrappers:

- the guard rides on the torch optimizer inside the `AcceleratedOptimizer`: that one steps only
  on the micro-batch where `accelerator.sync_gradients` is true (under `accumulate`), so the
  guard's step is the optimizer's real step and its checks and snapshots cover every micro-batch
  of it; the wrapper's own `step()` runs on every micro-batch;
- the LR scheduler snapshotted is the one inside the `AcceleratedScheduler`; the step a start-up
  resume makes for the loop (mscale.hook.core.protect) goes through the `AcceleratedScheduler`;
- with `mixed_precision="fp16"` the accelerator's GradScaler is watched (the step ends at its
  update, and a step it skips is known); "bf16" needs nothing (autocast, no scaler);
- the rank is the accelerator's `process_index`;
- a `mscale.ResumableLoader` given as `data` must be split like the accelerator's processes.

The model is the prepared one (DDP-wrapped with several processes; its MPUs are found under
`module.`). Everything else is `mscale.attach`'s: `snapshots`, `data`, `resume`, `connect`, ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Unpack

from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from torch import nn

from mscale.hook.core.attach import attach as plain_attach
from mscale.hook.core.guard import Guard
from mscale.hook.core.null import NullGuard

if TYPE_CHECKING:
    from mscale.hook.core.options import AttachOptions
    from mscale.snapshot.values import Stateful

__all__ = ["attach"]


def attach(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: AcceleratedOptimizer,
    *,
    job_id: str,
    scheduler: Stateful | None = None,
    data: object = None,
    **kwargs: Unpack[AttachOptions],
) -> Guard | NullGuard:
    """Guard what `accelerator.prepare` returned; other keyword arguments are `mscale.attach`'s."""
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"accelerator: expected an accelerate.Accelerator, got {type(accelerator).__name__}")
    if not isinstance(optimizer, AcceleratedOptimizer):
        raise TypeError(
            f"optimizer: expected what accelerator.prepare returned (an AcceleratedOptimizer), "
            f"got {type(optimizer).__name__}: prepare it first, then attach"
        )
    if "rank" in kwargs and kwargs["rank"] != accelerator.process_index:
        raise ValueError(f"rank={kwargs['rank']}: the accelerator's process_index is {accelerator.process_index}")
    split = (getattr(data, "rank", None), getattr(data, "world_size", None))
    if split[1] is not None and split != (accelerator.process_index, accelerator.num_processes):
        raise ValueError(
            f"data: split as rank {split[0]} of {split[1]}, but this is process {accelerator.process_index} "
            f"of {accelerator.num_processes}: build it with rank=accelerator.process_index, "
            "world_size=accelerator.num_processes"
        )
    kwargs["rank"] = accelerator.process_index
    if accelerator.scaler is not None:
        kwargs.setdefault("scaler", accelerator.scaler)
    held = _SchedulerAtCommit(scheduler) if isinstance(scheduler, AcceleratedScheduler) else scheduler
    return plain_attach(model, optimizer.optimizer, job_id=job_id, scheduler=held, data=data, **kwargs)


class _SchedulerAtCommit:
    """The scheduler inside an AcceleratedScheduler, as the snapshots hold it; stepped (after a
    start-up resume, mscale.hook.core.protect) through the AcceleratedScheduler, so that its steps
    per process and its skipped-step rule are kept."""

    def __init__(self, prepared: AcceleratedScheduler) -> None:
        self.prepared = prepared

    def state_dict(self) -> dict[str, object]:
        return self.prepared.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.prepared.scheduler.load_state_dict(state)

    def step(self) -> None:
        self.prepared.step()

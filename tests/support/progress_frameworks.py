"""The progress matrix's framework set-ups (tests/support/progress_job.py): Lightning and
Accelerate, each with its own loop and the project's integration for it. `run` is the job's
`Run` (model, fault, counters, report)."""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

import mscale
from support.tiny_hf import Samples

LR = 3e-3
ACCUM = 2  # Accelerate's micro-batches per optimizer step


def lightning_run(run, args: argparse.Namespace) -> dict:
    """A LightningModule wrapping the model, `lightning.Trainer` (CPU, bf16-mixed, one batch a
    step, `max_steps` --steps), `MscaleCallback` with snapshots (none with --bare); the fault armed at each
    batch's start from the guard's step; --max-calls bounds the batches."""
    import lightning as L

    class Captioner(L.LightningModule):
        def __init__(self, model) -> None:
            super().__init__()
            self.model = model

        def forward(self, **batch):
            return self.model(**batch)

        def training_step(self, batch, batch_idx):
            return self(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    guarded = (
        None
        if args.bare
        else mscale.lightning.MscaleCallback(
            job_id="progress-lightning", snapshots=True, connect=False, plugins=[run.record]
        )
    )

    class Arm(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            run.guard = guarded.guard if guarded is not None else None
            run.arm_fault()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if run.guard is None:
                run.calls = trainer.global_step  # no guard: the step is Lightning's
            run.begin()  # Lightning stops at the target itself (max_steps, moved back by a rollback)
            run.calls += run.guard is not None  # one batch, one optimizer call

    t0 = time.perf_counter()
    trainer = L.Trainer(
        max_steps=args.steps,
        max_epochs=-1,
        precision="bf16-mixed",
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tempfile.mkdtemp(prefix="progress-lightning-"),
    )
    trainer.callbacks += [c for c in (guarded, Arm()) if c is not None]
    loader = torch.utils.data.DataLoader(Samples(run.make_batch, 4 * 64), batch_size=4, shuffle=False)
    try:
        trainer.fit(Captioner(run.model), loader)
    except Exception as e:
        run.failed(e)
    if run.guard is None:
        run.calls = trainer.global_step
    return run.finish(t0)


def accelerate_run(run, args: argparse.Namespace) -> dict:
    """Accelerate's own loop (`prepare`, `accumulate`, `backward`; one CPU process, bf16, ACCUM
    micro-batches a step) with `mscale.accelerate.attach` (none with --bare)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=ACCUM)
    t0 = time.perf_counter()
    opt = torch.optim.AdamW(run.model.parameters(), lr=LR)
    model, opt = accelerator.prepare(run.model, opt)
    loader = mscale.ResumableLoader(Samples(run.make_batch, 512), batch_size=2, seed=args.seed)
    try:
        if not args.bare:
            run.guard = mscale.accelerate.attach(
                accelerator,
                model,
                opt,
                job_id="progress-accelerate",
                snapshots=True,
                data=loader,
                connect=False,
                plugins=[run.record],
            )
        run.arm_fault()
        for batch in loader:
            if not run.begin():
                break
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                stepping = accelerator.sync_gradients
                opt.step()
                opt.zero_grad()
            run.calls += stepping
    except Exception as e:
        run.failed(e)
    return run.finish(t0)

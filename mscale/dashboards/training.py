"""Training stability: loss with its rolling band, gradient norms per MPU, spikes, rollbacks,
skipped batches, and the CUDA activity the eBPF probe sees."""
from __future__ import annotations

from mscale.dashboards.common import Ctx, Panel, dashboard

UID = "mscale-training"


def build(ctx: Ctx):
    s = ctx.sel(job=True)
    k = ctx.params["dashboards"]["loss_band_sigma"]
    avg = ctx.record("job:mscale_training_loss:avg$band")
    std = ctx.record("job:mscale_training_loss:stddev$band")
    band = ctx.window("band")
    return dashboard(ctx, uid=UID, title="mscale / Training stability", job=True,
                     description="Loss against its rolling band, gradient norms, spikes and the responses to them.",
                     rows=[
        ("Loss", [
            Panel(f"Loss with its rolling band (mean +- {k} sigma over {band})", [
                (f"mscale_training_loss{s}", "{{job_id}} loss"),
                (f"{avg}{s} + {k} * {std}{s}", "{{job_id}} upper"),
                (f"{avg}{s} - {k} * {std}{s}", "{{job_id}} lower"),
            ], width=24),
            Panel("Loss spikes", [(f"increase(mscale_loss_spikes_total{s}[$__rate_interval])", "{{job_id}} {{level}}")]),
            Panel("Non-finite losses", [(f"increase(mscale_loss_nonfinite_total{s}[$__rate_interval])", "{{job_id}}")]),
        ]),
        ("Gradients", [
            Panel("Gradient norm per MPU", [(f"mscale_mpu_grad_norm{s}", "{{job_id}} {{mpu_id}}")]),
            Panel("Global gradient norm", [(f"mscale_training_grad_norm{s}", "{{job_id}}")]),
        ]),
        ("Responses", [
            Panel("Rollbacks", [(f"mscale_rollbacks_total{s}", "{{job_id}}")], width=8),
            Panel("Skipped batches", [(f"mscale_skipped_batches_total{s}", "{{job_id}}")], width=8),
            Panel("LR cooling", [(f"mscale_lr_cooling{s}", "{{job_id}}")], width=8, min=0, max=1,
                  description="1 while the learning rate is cooled after a loss spike."),
        ]),
        ("CUDA activity (eBPF)", [
            Panel("Kernel launches per second", [(f"{ctx.record('job:mscale_cuda_kernel_launches:rate$rate')}{s}", "{{job_id}}")]),
            Panel("Share of time blocked in synchronise",
                  [(f"{ctx.record('job_pid:mscale_cuda_sync_seconds:rate$rate')}{s}", "{{job_id}} pid {{pid}}")],
                  unit="percentunit", min=0, max=1, threshold=ctx.alert("MscaleSyncStall")["ratio"]),
            Panel("Hung processes", [(f"mscale_cuda_hang{s}", "{{job_id}} pid {{pid}}")], min=0, max=1, threshold=1),
        ]),
    ])

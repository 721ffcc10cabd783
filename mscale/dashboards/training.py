"""Training stability: loss with its rolling band, gradient norms per MPU, spikes, rollbacks,
skipped batches, slow ranks and slow MPUs, and the CUDA activity the eBPF probe sees."""

from __future__ import annotations

from mscale.dashboards.common import Ctx, Panel, Row, dashboard

UID = "mscale-training"


def build(ctx: Ctx):
    return dashboard(
        ctx,
        uid=UID,
        title="mscale / Training stability",
        job=True,
        description="Loss against its rolling band, gradient norms, spikes and the responses to them.",
        rows=[_loss(ctx), _gradients(ctx), _goodput(ctx), _stragglers(ctx), _responses(ctx), _cuda(ctx)],
    )


def _loss(ctx: Ctx) -> Row:
    s = ctx.sel(job=True)
    k = ctx.params["dashboards"]["loss_band_sigma"]
    avg = ctx.record("job:mscale_job_loss:avg$band")
    std = ctx.record("job:mscale_job_loss:stddev$band")
    findings = ctx.record("job:mscale_job_findings:increase$event")
    band, rate, event = ctx.window("band"), ctx.window("rate"), ctx.window("event")
    return (
        "Loss",
        [
            Panel(
                f"Loss with its rolling band (mean +- {k} sigma over {band})",
                [
                    (f"mscale_job_loss{s}", "{{job_id}} loss"),
                    (f"{avg}{s} + {k} * {std}{s}", "{{job_id}} upper"),
                    (f"{avg}{s} - {k} * {std}{s}", "{{job_id}} lower"),
                ],
                width=24,
            ),
            Panel(
                f"Loss findings (last {event}): spikes, jumps, NaN",
                [
                    (
                        f'sum by (job_id, reason) ({findings}{{node=~"$node",job_id=~"$job_id",reason=~"loss_.*"}})',
                        "{{job_id}} {{reason}}",
                    )
                ],
                description="From the hook library's loss detector in each job.",
            ),
            Panel("Steps reported per second", [(f"rate(mscale_job_reports_total{s}[{rate}])", "{{job_id}}")]),
        ],
    )


def _gradients(ctx: Ctx) -> Row:
    s = ctx.sel(job=True)
    return (
        "Gradients",
        [
            Panel("Gradient norm per MPU", [(f"mscale_mpu_grad_norm{s}", "{{job_id}} {{mpu_id}}")]),
            Panel("Global gradient norm (before clipping)", [(f"mscale_job_grad_norm{s}", "{{job_id}}")]),
        ],
    )


def _goodput(ctx: Ctx) -> Row:
    s = ctx.sel(job=True)
    rate = ctx.window("rate")
    return (
        "Goodput",
        [
            Panel(
                f"Where the jobs' time goes (rank-seconds per second, {rate} rate)",
                [
                    (
                        f"sum by (job_id) (rate(mscale_job_goodput_seconds_total{s}[{rate}]))",
                        "{{job_id}} productive",
                    ),
                    (
                        f"sum by (job_id, cause) (rate(mscale_job_badput_seconds_total{s}[{rate}]))",
                        "{{job_id}} {{cause}}",
                    ),
                ],
                width=16,
                stack=True,
                description="Each rank's wall time by cause, stacked: productive steps, then the "
                "badput causes (start-up, snapshot stalls and restores, re-run steps, checks, "
                "degraded steps, data waits, hangs). The stack's height is the ranks running.",
            ),
            Panel(
                "Goodput ratio",
                [
                    (
                        f'{ctx.record("job:mscale_job_goodput:ratio_rate$rate")}{{job_id=~"$job_id"}}',
                        "{{job_id}}",
                    ),
                    (ctx.record("cluster:mscale_job_goodput:ratio_rate$rate"), "cluster"),
                ],
                width=8,
                unit="percentunit",
                min=0,
                max=1,
                description="The share of the wall time in productive steps, per job and over the cluster.",
            ),
        ],
    )


def _stragglers(ctx: Ctx) -> Row:
    s = ctx.sel(job=True)
    return (
        "Stragglers",
        [
            Panel(
                f"MPU time over the job's median (median over {ctx.window('straggler')})",
                [
                    (
                        f"{ctx.record('job_rank_mpu:mscale_mpu_latency:ratio_to_job_median')}{s}",
                        "{{job_id}} rank {{rank}} {{mpu_id}} {{phase}} ({{node}})",
                    )
                ],
                width=8,
                threshold=ctx.alert("MscaleStragglerMpu")["ratio"],
                description="Each rank's median forward/backward time of each MPU over the median of "
                "the same MPU on the job's ranks, on every node (recording rule). "
                "Above the line for the alert's duration: MscaleStragglerMpu.",
            ),
            Panel(
                f"Rank compute time over the job's median (median over {ctx.window('straggler')})",
                [
                    (
                        f"{ctx.record('job_rank:mscale_job_rank_compute:ratio_to_job_median')}{s}",
                        "{{job_id}} rank {{rank}} ({{node}})",
                    )
                ],
                width=8,
                threshold=ctx.alert("MscaleStragglerRank")["ratio"],
                description="A rank's MPUs' forward + backward time against the job's median: the "
                "step's wall time is the same on every rank, the compute time is not.",
            ),
            Panel(
                "Stragglers the agents found (ranks on one node)",
                [
                    (
                        f"mscale_straggler{s} == 1",
                        "{{job_id}} rank {{rank}} {{mpu}} {{phase}} gpu {{gpu}} ({{node}})",
                    )
                ],
                width=8,
                min=0,
                max=1,
                description="The node agent's verdicts (mscale_straggler): a rank or MPU slower than "
                "the job's other ranks on the node over the last stragglers.window_steps steps.",
            ),
        ],
    )


def _responses(ctx: Ctx) -> Row:
    s = ctx.sel(job=True)
    rollback = ctx.sel('action="rollback"')
    return (
        "Responses",
        [
            Panel(
                "Rollbacks",
                [(f"sum by (node, result) (mscale_heal_actions_total{rollback})", "{{node}} {{result}}")],
                width=8,
                description="Rollbacks to the last good snapshot decided by the healing engine.",
            ),
            Panel("Skipped batches", [(f"mscale_job_steps_skipped_total{s}", "{{job_id}}")], width=8),
            Panel(
                "LR cooling",
                [(f"mscale_lr_cooling{s}", "{{job_id}}")],
                width=8,
                min=0,
                max=1,
                description="1 while the learning rate is cooled after a loss spike.",
            ),
        ],
    )


def _cuda(ctx: Ctx) -> Row:
    s = ctx.sel(job=True)
    rate = ctx.window("rate")
    return (
        "CUDA activity (eBPF)",
        [
            Panel(
                "Kernel launches per second",
                [(f"{ctx.record('job:mscale_cuda_kernel_launches:rate$rate')}{s}", "{{job_id}}")],
            ),
            Panel(
                "Share of time blocked in synchronise",
                [(f"mscale_cuda_sync_blocked_ratio{s}", "{{job_id}} pid {{pid}}")],
                unit="percentunit",
                min=0,
                max=1,
                threshold=ctx.alert("MscaleSyncStall")["ratio"],
            ),
            Panel(
                "Synchronise call time p99",
                [
                    (
                        f"histogram_quantile(0.99, sum by (le, job_id, pid) (rate(mscale_cuda_sync_seconds_bucket{s}[{rate}])))",
                        "{{job_id}} pid {{pid}}",
                    )
                ],
                unit="s",
            ),
            Panel(
                "Hung processes",
                [(f"mscale_cuda_hang{s}", "{{job_id}} pid {{pid}}")],
                min=0,
                max=1,
                threshold=1,
            ),
        ],
    )

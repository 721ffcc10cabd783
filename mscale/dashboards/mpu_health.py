"""MPU health: health score per MPU, fuse level over time, drifts, checksums, CMSA clipping,
and the resources a contract gives each MPU (compute density against its profile, achieved
FLOP/s, the contract's compliance)."""

from __future__ import annotations

from mscale.dashboards.common import Ctx, Panel, Row, dashboard

UID = "mscale-mpu-health"


def build(ctx: Ctx):
    return dashboard(
        ctx,
        uid=UID,
        title="mscale / MPU health",
        job=True,
        description="Per-MPU health score (0-100), three-level fuse, drifts, checksums and CMSA clipping.",
        rows=[_health(ctx), _fuse(ctx), _resources(ctx)],
    )


def _health(ctx: Ctx) -> Row:
    s = ctx.sel(job=True)
    score = ctx.alert("MscaleMpuHealthLow")["score"]
    health = ctx.record("job_mpu:mpu_health_score:min")
    return (
        "Health score",
        [
            Panel(
                "Health score per MPU",
                [(f"{health}{s}", "{{job_id}} r{{rank}} {{mpu}} ({{mpu_id}})")],
                min=0,
                max=100,
                threshold=score,
                threshold_below=True,
                description=f"Lowest score over the phases; below {score} the MscaleMpuHealthLow alert fires.",
            ),
            Panel(
                "Health score by phase",
                [(f"mpu_health_score{s}", "{{job_id}} r{{rank}} {{mpu}} {{phase}}")],
                min=0,
                max=100,
                threshold=score,
                threshold_below=True,
            ),
            Panel(
                "MPUs below the threshold",
                [(f"count({health}{s} < {score}) or vector(0)", "MPUs")],
                kind="stat",
                width=6,
                height=4,
                threshold=1,
            ),
            Panel("MPUs watched", [(f"count({health}{s}) or vector(0)", "MPUs")], kind="stat", width=6, height=4),
        ],
    )


def _fuse(ctx: Ctx) -> Row:
    s = ctx.sel(job=True)
    return (
        "Fuse",
        [
            Panel(
                "Fuse level over time",
                [(f"mscale_fuse_level{s}", "{{job_id}} {{mpu_id}}")],
                min=0,
                max=3,
                threshold=2,
                description="0 none, 1 swapped (L1), 2 degraded (L2), 3 distilling (L3).",
            ),
            Panel(
                "Drifts (L1 moves to a standby device)",
                [(f"mpu_drift_count_total{s}", "{{job_id}} {{mpu_id}}")],
                description="Cumulative moves of each MPU (mpu_drift_count_total).",
            ),
            Panel(
                "Latency against the MPU's own baseline",
                [
                    (
                        f"mscale_mpu_latency_seconds{s} / on (instance, job_id, rank, mpu_id, phase) mscale_mpu_latency_baseline_seconds{s}",
                        "{{job_id}} r{{rank}} {{mpu_id}} {{phase}}",
                    )
                ],
                unit="short",
                description="Forward/backward time of the last step over the median of the MPU's first steps.",
            ),
            Panel(
                "Checksum failures",
                [
                    (
                        f"increase(mscale_mpu_checksum_failures_total{s}[$__rate_interval])",
                        "{{job_id}} {{mpu_id}}",
                    )
                ],
            ),
            Panel(
                "CMSA clip ratio",
                [(f"cmsa_clip_ratio{s}", "{{job_id}} {{mpu_id}}")],
                unit="percentunit",
                min=0,
                max=1,
                threshold=ctx.alert("MscaleCmsaClipHigh")["ratio"],
                description="Share of steps in which CMSA clipped the MPU's gradients.",
            ),
        ],
    )


def _resources(ctx: Ctx) -> Row:
    s = ctx.sel(job=True)
    return (
        "Resources (contracts, MSRP)",
        [
            Panel(
                "Compute density against the contract's profile",
                [
                    (f"mscale_mpu_compute_density{s}", "{{job_id}} {{mpu_id}} measured"),
                    (f"mscale_mpu_density_expected{s}", "{{job_id}} {{mpu_id}} {{profile}}"),
                ],
                unit="short",
                description="Achieved TFLOP/s per GB of the MPU's memory; the density guard recommends "
                "another profile when they part by more than contract.density_deviation.",
            ),
            Panel(
                "Achieved FLOP/s per MPU",
                [(f"mscale_mpu_achieved_flops{s}", "{{job_id}} {{mpu_id}}")],
                unit="short",
                description="Step FLOPs (FlopCounterMode) over forward + backward time.",
            ),
            Panel(
                "Contract compliance",
                [(f"min by (job_id) (mscale_contract_compliant{s})", "{{job_id}}")],
                min=0,
                max=1,
                description="1: every named I/O thread and loader worker runs on its planned CPUs.",
            ),
        ],
    )

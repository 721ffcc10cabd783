"""Healing and snapshots: actions by fuse level, fuse states, findings, snapshot durations,
sizes and age, recovery time; the remediation hand-off (GPUs shown at fault, filings)."""

from __future__ import annotations

from mscale.dashboards.common import Ctx, Panel, Row, dashboard

UID = "mscale-healing"


def build(ctx: Ctx):
    return dashboard(
        ctx,
        uid=UID,
        title="mscale / Healing and snapshots",
        job=True,
        description="What the healing engine decided and did, and the snapshots it relies on.",
        rows=[_healing(ctx), _snapshots(ctx), _remediation(ctx)],
    )


def _healing(ctx: Ctx) -> Row:
    s, n = ctx.sel(job=True), ctx.sel()
    return (
        "Healing",
        [
            Panel(
                f"Actions by level (last {ctx.window('event')})",
                [
                    (
                        f'sum by (level) ({ctx.record("node:mscale_heal_actions:increase$event")}{{node=~"$node"}})',
                        "{{level}}",
                    )
                ],
            ),
            Panel(
                "Actions",
                [
                    (
                        f"sum by (level, action, result) (increase(mscale_heal_actions_total{n}[$__rate_interval]))",
                        "{{level}} {{action}} {{result}}",
                    )
                ],
                stack=True,
            ),
            Panel("Fuse state per MPU", [(f"mscale_fuse_state{s} == 1", "{{job_id}} {{mpu_id}} {{state}}")]),
            Panel(
                f"Findings by reason (last {ctx.window('event')})",
                [
                    (
                        f'sum by (reason) ({ctx.record("node:mscale_events:increase$event")}{{node=~"$node"}})',
                        "{{reason}}",
                    )
                ],
            ),
        ],
    )


def _snapshots(ctx: Ctx) -> Row:
    s = ctx.sel(job=True)
    rate = ctx.window("rate")
    return (
        "Snapshots",
        [
            Panel(
                "Snapshot duration (p50, p99)",
                [
                    (
                        f"histogram_quantile(0.5, sum by (le, job_id) (rate(mscale_snapshot_duration_seconds_bucket{s}[{rate}])))",
                        "{{job_id}} p50",
                    ),
                    (
                        f"histogram_quantile(0.99, sum by (le, job_id) (rate(mscale_snapshot_duration_seconds_bucket{s}[{rate}])))",
                        "{{job_id}} p99",
                    ),
                ],
                unit="s",
            ),
            Panel("Snapshot size", [(f"mscale_snapshot_size_bytes{s}", "{{job_id}}")], unit="bytes"),
            Panel(
                "Age of the last good snapshot",
                [(f"time() - mscale_snapshot_last_success_timestamp_seconds{s}", "{{job_id}}")],
                unit="s",
                threshold=ctx.alert("MscaleSnapshotStale")["max_age_s"],
            ),
            Panel(
                "Recovery time",
                [(f"checkpoint_recovery_time_seconds{s}", "{{job_id}} {{tag}}")],
                unit="s",
                description="Time to restore a snapshot, by what triggered it (tag).",
            ),
            Panel(
                "Snapshot failures",
                [(f"increase(mscale_snapshot_failures_total{s}[$__rate_interval])", "{{job_id}}")],
                width=24,
            ),
        ],
    )


def _remediation(ctx: Ctx) -> Row:
    n = ctx.sel()
    return (
        "Remediation hand-off",
        [
            Panel(
                "GPUs shown at fault",
                [
                    (
                        f"mscale_remediation_gpu_fault{n} == 1",
                        "{{node}} GPU {{gpu}} {{kind}} {{reason}} {{action}}",
                    )
                ],
                description="An SDC verdict of the fuse (an L1 swap off the GPU came clean on the standby) "
                "or a fatal Xid, until the GPU was reset and passed its checks.",
            ),
            Panel(
                "Filings held",
                [(f"sum by (node, filer) (mscale_remediation_filed{n})", "{{node}} {{filer}}")],
                description="ExternalFault objects, SDC node conditions and command-hook filings standing now.",
            ),
            Panel(
                "Files and undos",
                [
                    (
                        f"sum by (filer, event, result) (increase(mscale_remediation_filings_total{n}[$__rate_interval]))",
                        "{{filer}} {{event}} {{result}}",
                    )
                ],
                stack=True,
                width=24,
                description="failed: retried after remediation.retry_interval_s; deferred: over "
                "remediation.max_filings_per_hour.",
            ),
        ],
    )

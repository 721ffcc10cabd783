"""GPU node: temperature, power, memory, utilisation, ECC, Xid, throttling, PCIe, NVLink, the agent."""

from __future__ import annotations

from mscale.dashboards.common import Ctx, Panel, Row, dashboard

UID = "mscale-gpu-node"
GPU = "{{node}} GPU {{gpu}}"


def _state(name: str) -> str:
    return f'state="{name}"'


def build(ctx: Ctx):
    return dashboard(
        ctx,
        uid=UID,
        title="mscale / GPU node",
        gpu=True,
        description="Every GPU of the selected nodes as the mscale agent sees it (NVML or dcgm-exporter).",
        rows=[_health(ctx), _thermal(ctx), _memory(ctx), _ecc(ctx), _links(ctx), _agent(ctx)],
    )


def _health(ctx: Ctx) -> Row:
    s = ctx.sel(gpu=True)
    return (
        "Health",
        [
            Panel(
                "GPU health (0 healthy, 1 degraded, 2 failed)",
                [
                    (
                        f"sum by (node, gpu) (mscale_gpu_health{ctx.sel(_state('degraded'), gpu=True)}) "
                        f"+ 2 * sum by (node, gpu) (mscale_gpu_health{ctx.sel(_state('failed'), gpu=True)})",
                        GPU,
                    )
                ],
                min=0,
                max=2,
                threshold=2,
            ),
            Panel(
                f"Xid errors (last {ctx.window('event')})",
                [(f"{ctx.record('gpu:mscale_gpu_xid_errors:increase$event')}{s}", GPU + " Xid {{xid}}")],
            ),
        ],
    )


def _thermal(ctx: Ctx) -> Row:
    s = ctx.sel(gpu=True)
    return (
        "Thermal and power",
        [
            Panel(
                "Temperature",
                [(f"mscale_gpu_temperature_celsius{s}", GPU)],
                unit="celsius",
                threshold=ctx.alert("MscaleGpuTemperatureHigh")["celsius"],
            ),
            Panel("Power", [(f"mscale_gpu_power_watts{s}", GPU)], unit="watt"),
            Panel(
                "GPUs throttled, by reason",
                [(f"sum by (node, reason) (mscale_gpu_clocks_throttled{s})", "{{node}} {{reason}}")],
                description="How many of the selected GPUs have their clocks held back, for each reason.",
            ),
            Panel("SM clock", [(f"mscale_gpu_sm_clock_hertz{s}", GPU)], unit="hertz"),
        ],
    )


def _memory(ctx: Ctx) -> Row:
    s = ctx.sel(gpu=True)
    return (
        "Memory and utilisation",
        [
            Panel("Memory used", [(f"mscale_gpu_memory_used_bytes{s}", GPU)], unit="bytes"),
            Panel("Utilisation", [(f"mscale_gpu_utilization_ratio{s}", GPU)], unit="percentunit", min=0, max=1),
        ],
    )


def _ecc(ctx: Ctx) -> Row:
    s = ctx.sel(gpu=True)
    return (
        "ECC",
        [
            Panel(
                f"ECC errors (last {ctx.window('event')})",
                [
                    (
                        f"{ctx.record('gpu:mscale_gpu_ecc_errors:increase$event')}{s}",
                        GPU + " {{type}} {{counter}}",
                    )
                ],
            ),
            Panel("Remapped rows", [(f"mscale_gpu_remapped_rows{s}", GPU + " {{type}}")]),
        ],
    )


def _links(ctx: Ctx) -> Row:
    s = ctx.sel(gpu=True)
    rate = ctx.window("rate")
    return (
        "PCIe and NVLink",
        [
            Panel("PCIe replays per second", [(f"rate(mscale_gpu_pcie_replays_total{s}[{rate}])", GPU)]),
            Panel(
                "PCIe throughput",
                [(f"mscale_gpu_pcie_throughput_bytes_per_second{s}", GPU + " {{direction}}")],
                unit="Bps",
            ),
            Panel("NVLink links up", [(f"sum by (node, gpu) (mscale_gpu_nvlink_up{s})", GPU)]),
            Panel(
                "NVLink errors per second",
                [
                    (
                        f"sum by (node, gpu, type) (rate(mscale_gpu_nvlink_errors_total{s}[{rate}]))",
                        GPU + " {{type}}",
                    )
                ],
            ),
        ],
    )


def _agent(ctx: Ctx) -> Row:
    rate = ctx.window("rate")
    return (
        "Agent",
        [
            Panel(
                "Probes up",
                [(f"mscale_probe_up{ctx.sel()}", "{{node}} {{probe}}")],
                min=0,
                max=1,
                threshold=1,
                threshold_below=True,
            ),
            Panel(
                "Probe sample duration",
                [(f"mscale_probe_duration_seconds{ctx.sel()}", "{{node}} {{probe}}")],
                unit="s",
            ),
            Panel(
                "Findings per second by reason",
                [
                    (
                        f"sum by (node, reason) (rate(mscale_events_total{ctx.sel()}[{rate}]))",
                        "{{node}} {{reason}}",
                    )
                ],
                width=24,
            ),
        ],
    )

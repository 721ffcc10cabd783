"""GPU metrics from the GPU probe's latest snapshot: mscale_gpu_*, base units, labelled
with `gpu` (the index) and `gpu_uuid`. A field the GPU does not report has no series."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mscale.daemon.state import AgentState
from mscale.probes.gpu_health import STATES, XID_UNLISTED
from mscale.probes.gpu_sample import GpuSample
from mscale.probes.nvml_api import RECOVERY_ACTIONS, THROTTLE_REASONS

Family = GaugeMetricFamily | CounterMetricFamily
G, C = GaugeMetricFamily, CounterMetricFamily
L = ["gpu", "gpu_uuid"]

# (metric, help, GpuSample field) for the plain per-GPU gauges
GAUGES: tuple[tuple[str, str, str], ...] = (
    ("mscale_gpu_temperature_celsius", "GPU core temperature", "temperature_c"),
    ("mscale_gpu_power_watts", "power draw", "power_w"),
    ("mscale_gpu_power_limit_watts", "enforced power limit", "power_limit_w"),
    ("mscale_gpu_memory_used_bytes", "framebuffer memory in use", "memory_used_bytes"),
    ("mscale_gpu_memory_total_bytes", "framebuffer memory in all", "memory_total_bytes"),
    ("mscale_gpu_utilization_ratio", "share of time a kernel ran (0-1)", "utilization_gpu_ratio"),
    (
        "mscale_gpu_memory_utilization_ratio",
        "share of time memory was read or written (0-1)",
        "utilization_memory_ratio",
    ),
    ("mscale_gpu_sm_clock_hertz", "SM clock", "sm_clock_hz"),
    ("mscale_gpu_memory_clock_hertz", "memory clock", "memory_clock_hz"),
    (
        "mscale_gpu_recovery_action",
        "what the driver says the GPU needs: " + ", ".join(f"{k} {v}" for k, v in RECOVERY_ACTIONS.items()),
        "recovery_action",
    ),
)


# key, kind, name, help, labels: in the order a scrape shows them (the plain gauges keyed by
# their GpuSample field)
FAMILIES: tuple[tuple[str, type[Family], str, str, list[str]], ...] = (
    ("info", G, "mscale_gpu_info", "one series per GPU: its name and backend", L + ["name", "backend"]),
    ("health", G, "mscale_gpu_health", "1 for the GPU's current health state, 0 for the others", L + ["state"]),
    ("lost", G, "mscale_gpu_lost", "1 if the GPU has fallen off the bus (NVML: GPU is lost)", L),
    *((field, G, name, help_, L) for name, help_, field in GAUGES),
    ("throttle", G, "mscale_gpu_clocks_throttled", "1 if clocks are held back for this reason", L + ["reason"]),
    (
        "ecc",
        C,
        "mscale_gpu_ecc_errors",
        "ECC errors; volatile since the last reset, aggregate over the GPU's life",
        L + ["type", "counter"],
    ),
    ("retired", G, "mscale_gpu_retired_pages", "memory pages retired, by cause", L + ["cause"]),
    ("retired_pending", G, "mscale_gpu_retired_pages_pending", "1 if a page retirement waits for a reset", L),
    ("rows", G, "mscale_gpu_remapped_rows", "memory rows remapped, by the kind of error", L + ["type"]),
    ("rows_pending", G, "mscale_gpu_remapped_rows_pending", "1 if a row remap waits for a reset", L),
    ("rows_failed", G, "mscale_gpu_remapped_rows_failed", "1 if a row remap failed", L),
    ("replays", C, "mscale_gpu_pcie_replays", "PCIe replays", L),
    ("pcie", G, "mscale_gpu_pcie_throughput_bytes_per_second", "PCIe throughput", L + ["direction"]),
    ("link_up", G, "mscale_gpu_nvlink_up", "1 if the NVLink link is active", L + ["link"]),
    # Errors summed over the GPU's links (as dcgm-exporter does): per link they would be 4 x 18
    # series per GPU, most of the page; the per-link figures are in /api/v1/gpus.
    ("link_err", C, "mscale_gpu_nvlink_errors", "NVLink data-link errors, summed over the GPU's links", L + ["type"]),
    ("xid", C, "mscale_gpu_xid_errors", "Xid errors received since the agent started", L + ["xid", "action"]),
)


def _n(v: float) -> float:
    return float(v)  # bools too


def collect(state: AgentState) -> Iterable[Metric]:
    snap = state.snapshots.get("gpu")
    if snap is None:
        return
    f: dict[str, Family] = {key: kind(name, doc, labels=labels) for key, kind, name, doc, labels in FAMILIES}
    for g in snap.gpus:
        lv = [str(g.index), g.uuid]
        _add_state(f, lv, g, snap.backend)
        _add_memory_errors(f, lv, g)
        _add_pcie(f, lv, g)
        _add_nvlinks(f, lv, g)
        actions = dict(g.xid_actions)
        for code, count in g.xid_errors:
            f["xid"].add_metric(lv + [str(code), actions.get(code, XID_UNLISTED)], count)
    yield from f.values()


def _add_state(f: dict[str, Family], lv: list[str], g: GpuSample, backend: str) -> None:
    """What the GPU is and how it is: its info, health and loss, the plain gauges, throttling."""
    f["info"].add_metric(lv + [g.name, backend], 1.0)
    for s in STATES:
        f["health"].add_metric(lv + [s], 1.0 if g.health == s else 0.0)
    f["lost"].add_metric(lv, 1.0 if g.lost else 0.0)
    for _, _, fld in GAUGES:
        v = getattr(g, fld)
        if v is not None:
            f[fld].add_metric(lv, _n(v))
    if g.throttle_reasons is not None:
        for reason in THROTTLE_REASONS:
            f["throttle"].add_metric(lv + [reason], 1.0 if reason in g.throttle_reasons else 0.0)


def _add_memory_errors(f: dict[str, Family], lv: list[str], g: GpuSample) -> None:
    """ECC errors, retired pages and remapped rows, each where the GPU reports it."""
    for typ, counter, v in (
        ("single_bit", "volatile", g.ecc_sbe_volatile),
        ("double_bit", "volatile", g.ecc_dbe_volatile),
        ("single_bit", "aggregate", g.ecc_sbe_aggregate),
        ("double_bit", "aggregate", g.ecc_dbe_aggregate),
    ):
        if v is not None:
            f["ecc"].add_metric(lv + [typ, counter], v)
    if g.retired_pages_sbe is not None:
        f["retired"].add_metric(lv + ["single_bit"], g.retired_pages_sbe)
        f["retired"].add_metric(lv + ["double_bit"], g.retired_pages_dbe or 0)
    if g.retired_pages_pending is not None:
        f["retired_pending"].add_metric(lv, _n(g.retired_pages_pending))
    if g.remapped_rows_correctable is not None:
        f["rows"].add_metric(lv + ["correctable"], g.remapped_rows_correctable)
        f["rows"].add_metric(lv + ["uncorrectable"], g.remapped_rows_uncorrectable or 0)
    if g.remapped_rows_pending is not None:
        f["rows_pending"].add_metric(lv, _n(g.remapped_rows_pending))
    if g.remapped_rows_failed is not None:
        f["rows_failed"].add_metric(lv, _n(g.remapped_rows_failed))


def _add_pcie(f: dict[str, Family], lv: list[str], g: GpuSample) -> None:
    if g.pcie_replay_count is not None:
        f["replays"].add_metric(lv, g.pcie_replay_count)
    if g.pcie_tx_bytes_per_second is not None:
        f["pcie"].add_metric(lv + ["tx"], g.pcie_tx_bytes_per_second)
    if g.pcie_rx_bytes_per_second is not None:
        f["pcie"].add_metric(lv + ["rx"], g.pcie_rx_bytes_per_second)


def _add_nvlinks(f: dict[str, Family], lv: list[str], g: GpuSample) -> None:
    """Each link up or not; the errors summed over the links, by type."""
    totals: dict[str, int] = {}
    for link in g.nvlinks:
        f["link_up"].add_metric(lv + [str(link.link)], 1.0 if link.up else 0.0)
        for typ, v in (
            ("replay", link.replay_errors),
            ("recovery", link.recovery_errors),
            ("crc_flit", link.crc_flit_errors),
            ("crc_data", link.crc_data_errors),
        ):
            if v is not None:
                totals[typ] = totals.get(typ, 0) + v
    for typ, v in totals.items():
        f["link_err"].add_metric(lv + [typ], v)

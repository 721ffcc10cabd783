"""Collector for the eBPF CUDA-driver probe (mscale/probes/ebpf.py): what each traced
process does with the driver, and whether it hangs or stalls in synchronise calls."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from mscale.daemon.state import AgentState

if TYPE_CHECKING:
    from mscale.probes.ebpf import EbpfSnapshot
    from mscale.probes.ebpf_process import CudaProcess

# Exported sync-time buckets: the BPF log2 slots 10..36, i.e. upper bounds 2^10 ns (~1 us)
# to 2^36 ns (~69 s). Faster calls fold into the first bucket, slower ones only into +Inf.
SLOT_MIN, SLOT_MAX = 10, 36
LABELS = ["pid", "job_id"]
Family = GaugeMetricFamily | CounterMetricFamily
G, C = GaugeMetricFamily, CounterMetricFamily

# key, kind, name, help, labels: the per-process families but the synchronise histogram
FAMILIES: tuple[tuple[str, type[Family], str, str, list[str]], ...] = (
    (
        "launches",
        C,
        "mscale_cuda_kernel_launches",
        "kernel launches (cuLaunchKernel[Ex]); extrapolated from the duty windows when mscale_cuda_sampled is 1",
        LABELS,
    ),
    (
        "launches_seen",
        C,
        "mscale_cuda_kernel_launches_observed",
        "kernel launches the probe saw while attached",
        LABELS,
    ),
    (
        "graphs",
        C,
        "mscale_cuda_graph_launches",
        "CUDA graph launches (cuGraphLaunch); extrapolated like the kernel launches",
        LABELS,
    ),
    (
        "copied",
        C,
        "mscale_cuda_memcpy_bytes",
        "bytes in async copies, by direction (htod, dtoh, dtod, default: inferred by "
        "the driver); extrapolated like the launches",
        LABELS + ["direction"],
    ),
    (
        "copied_seen",
        C,
        "mscale_cuda_memcpy_bytes_observed",
        "bytes in async copies the probe saw while attached",
        LABELS + ["direction"],
    ),
    ("alloc", C, "mscale_cuda_alloc_failures", "cuMemAlloc calls that failed", LABELS),
    (
        "hang",
        G,
        "mscale_cuda_hang",
        "1 while the process is judged hung (no launch, or a synchronise call blocked, for "
        "longer than probes.ebpf.hang_timeout_s; the finding says which)",
        LABELS,
    ),
    (
        "inflight",
        G,
        "mscale_cuda_sync_inflight_seconds",
        "how long the longest synchronise call in flight has been blocked",
        LABELS,
    ),
    (
        "ratio",
        G,
        "mscale_cuda_sync_blocked_ratio",
        "share of wall time blocked in synchronise calls over "
        "probes.ebpf.sync_stall_window_s (summed over threads, capped at 1)",
        LABELS,
    ),
)


def sync_buckets(hist: tuple[int, ...]) -> list[tuple[str, int]]:
    """Cumulative Prometheus buckets from BPF log2 slots (slot s: [2^(s-1), 2^s) ns)."""
    out, total = [], 0
    for slot, n in enumerate(hist):
        total += n
        if slot >= SLOT_MIN and slot <= SLOT_MAX:
            out.append((repr(2.0**slot / 1e9), total))
    out.append(("+Inf", total))
    return out


def collect(state: AgentState) -> Iterable[Metric]:
    snap = state.snapshots.get("ebpf")
    if snap is None:
        return
    yield from _per_process(snap.processes)
    yield from _probe_gauges(snap)


def _per_process(processes: tuple[CudaProcess, ...]) -> Iterator[Metric]:
    """Each traced process's counts, synchronise times and verdicts. No traced process: no
    per-process families (rather than empty ones)."""
    f: dict[str, Family] = {key: kind(name, doc, labels=labels) for key, kind, name, doc, labels in FAMILIES}
    sync = HistogramMetricFamily(
        "mscale_cuda_sync_seconds",
        "time blocked in cuStreamSynchronize/cuCtxSynchronize per call (every call: this probe is never duty-cycled)",
        labels=LABELS,
    )
    for p in processes:
        lv = [str(p.pid), p.job_id]
        f["launches"].add_metric(lv, p.launches)
        f["launches_seen"].add_metric(lv, p.launches_observed)
        f["graphs"].add_metric(lv, p.graph_launches)
        for direction, n in p.memcpy_bytes:
            f["copied"].add_metric(lv + [direction], n)
        for direction, n in p.memcpy_bytes_observed:
            f["copied_seen"].add_metric(lv + [direction], n)
        sync.add_metric(lv, sync_buckets(p.sync_hist), p.sync_seconds_sum)
        f["alloc"].add_metric(lv, p.alloc_failures)
        f["hang"].add_metric(lv, 1.0 if p.hang else 0.0)
        f["inflight"].add_metric(lv, p.sync_inflight_s)
        if p.sync_blocked_ratio is not None:
            f["ratio"].add_metric(lv, p.sync_blocked_ratio)
    if processes:
        yield from (f["launches"], f["launches_seen"], f["graphs"], f["copied"], f["copied_seen"], sync)
        yield from (f["alloc"], f["hang"], f["inflight"])
    if f["ratio"].samples:
        yield f["ratio"]


def _probe_gauges(snap: EbpfSnapshot) -> Iterator[Metric]:
    """The probe's own figures: its duty cycle and what it traces."""
    for name, doc, value in (
        (
            "mscale_cuda_sampled",
            "1 when launch/copy counts are extrapolated from duty "
            "windows, 0 when the probes are always attached (exact counts)",
            1.0 if snap.sampled else 0.0,
        ),
        (
            "mscale_cuda_duty_window_seconds",
            "how long the launch/copy probes stay attached in each duty period",
            snap.duty_window_s,
        ),
        ("mscale_cuda_duty_period_seconds", "the duty period of the launch/copy probes", snap.duty_period_s),
        (
            "mscale_cuda_launch_probe_attached",
            "1 while the launch/copy probes are attached",
            1.0 if snap.launch_probe_attached else 0.0,
        ),
        ("mscale_cuda_traced_processes", "processes the probe is attached to", len(snap.processes)),
        (
            "mscale_cuda_untraced_processes",
            "target processes not traced yet (no libcuda "
            "mapped, not running, attach failed: the log event ebpf_not_traced says which)",
            len(snap.pending),
        ),
    ):
        yield GaugeMetricFamily(name, doc, value=value)

"""Collector for the eBPF CUDA-driver probe (mscale/probes/ebpf.py): what each traced
process does with the driver, and whether it hangs or stalls in synchronise calls."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from mscale.daemon.state import AgentState

# Exported sync-time buckets: the BPF log2 slots 10..36, i.e. upper bounds 2^10 ns (~1 us)
# to 2^36 ns (~69 s). Faster calls fold into the first bucket, slower ones only into +Inf.
SLOT_MIN, SLOT_MAX = 10, 36
LABELS = ["pid", "job_id"]


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
    launches = CounterMetricFamily(
        "mscale_cuda_kernel_launches",
        "kernel launches (cuLaunchKernel[Ex]); extrapolated from the duty windows when mscale_cuda_sampled is 1",
        labels=LABELS,
    )
    launches_seen = CounterMetricFamily(
        "mscale_cuda_kernel_launches_observed", "kernel launches the probe saw while attached", labels=LABELS
    )
    graphs = CounterMetricFamily(
        "mscale_cuda_graph_launches",
        "CUDA graph launches (cuGraphLaunch); extrapolated like the kernel launches",
        labels=LABELS,
    )
    copied = CounterMetricFamily(
        "mscale_cuda_memcpy_bytes",
        "bytes in async copies, by direction (htod, dtoh, dtod, default: inferred by "
        "the driver); extrapolated like the launches",
        labels=LABELS + ["direction"],
    )
    copied_seen = CounterMetricFamily(
        "mscale_cuda_memcpy_bytes_observed",
        "bytes in async copies the probe saw while attached",
        labels=LABELS + ["direction"],
    )
    sync = HistogramMetricFamily(
        "mscale_cuda_sync_seconds",
        "time blocked in cuStreamSynchronize/cuCtxSynchronize per call (every call: this probe is never duty-cycled)",
        labels=LABELS,
    )
    alloc = CounterMetricFamily("mscale_cuda_alloc_failures", "cuMemAlloc calls that failed", labels=LABELS)
    hang = GaugeMetricFamily(
        "mscale_cuda_hang",
        "1 while the process is judged hung (no launch, or a synchronise call blocked, for "
        "longer than probes.ebpf.hang_timeout_s; the finding says which)",
        labels=LABELS,
    )
    inflight = GaugeMetricFamily(
        "mscale_cuda_sync_inflight_seconds",
        "how long the longest synchronise call in flight has been blocked",
        labels=LABELS,
    )
    ratio = GaugeMetricFamily(
        "mscale_cuda_sync_blocked_ratio",
        "share of wall time blocked in synchronise calls over "
        "probes.ebpf.sync_stall_window_s (summed over threads, capped at 1)",
        labels=LABELS,
    )
    for p in snap.processes:
        lv = [str(p.pid), p.job_id]
        launches.add_metric(lv, p.launches)
        launches_seen.add_metric(lv, p.launches_observed)
        graphs.add_metric(lv, p.graph_launches)
        for direction, n in p.memcpy_bytes:
            copied.add_metric(lv + [direction], n)
        for direction, n in p.memcpy_bytes_observed:
            copied_seen.add_metric(lv + [direction], n)
        sync.add_metric(lv, sync_buckets(p.sync_hist), p.sync_seconds_sum)
        alloc.add_metric(lv, p.alloc_failures)
        hang.add_metric(lv, 1.0 if p.hang else 0.0)
        inflight.add_metric(lv, p.sync_inflight_s)
        if p.sync_blocked_ratio is not None:
            ratio.add_metric(lv, p.sync_blocked_ratio)
    if snap.processes:  # no traced process: no per-process families (rather than empty ones)
        yield from (launches, launches_seen, graphs, copied, copied_seen, sync, alloc, hang, inflight)
    if ratio.samples:
        yield ratio

    sampled = GaugeMetricFamily(
        "mscale_cuda_sampled",
        "1 when launch/copy counts are extrapolated from duty "
        "windows, 0 when the probes are always attached (exact counts)",
    )
    sampled.add_metric([], 1.0 if snap.sampled else 0.0)
    window = GaugeMetricFamily(
        "mscale_cuda_duty_window_seconds", "how long the launch/copy probes stay attached in each duty period"
    )
    window.add_metric([], snap.duty_window_s)
    period = GaugeMetricFamily("mscale_cuda_duty_period_seconds", "the duty period of the launch/copy probes")
    period.add_metric([], snap.duty_period_s)
    attached = GaugeMetricFamily("mscale_cuda_launch_probe_attached", "1 while the launch/copy probes are attached")
    attached.add_metric([], 1.0 if snap.launch_probe_attached else 0.0)
    traced = GaugeMetricFamily("mscale_cuda_traced_processes", "processes the probe is attached to")
    traced.add_metric([], len(snap.processes))
    untraced = GaugeMetricFamily(
        "mscale_cuda_untraced_processes",
        "target processes not traced yet (no libcuda "
        "mapped, not running, attach failed: the log event ebpf_not_traced says which)",
    )
    untraced.add_metric([], len(snap.pending))
    yield from (sampled, window, period, attached, traced, untraced)

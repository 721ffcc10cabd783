"""Host metrics (mscale_host_*) and training-process metrics (mscale_process_*{job_id,pid})
from the host probe's latest snapshot."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mscale.daemon.state import AgentState

# (metric without _total, help, DiskSample field)
DISK = (
    ("mscale_host_disk_read_bytes", "bytes read from the device", "read_bytes"),
    ("mscale_host_disk_written_bytes", "bytes written to the device", "written_bytes"),
    ("mscale_host_disk_reads_completed", "reads completed", "reads"),
    ("mscale_host_disk_writes_completed", "writes completed", "writes"),
    ("mscale_host_disk_io_time_seconds", "time the device was busy", "io_time_s"),
)
NIC = (
    ("mscale_host_network_receive_bytes", "bytes received", "receive_bytes"),
    ("mscale_host_network_transmit_bytes", "bytes sent", "transmit_bytes"),
    ("mscale_host_network_receive_packets", "packets received", "receive_packets"),
    ("mscale_host_network_transmit_packets", "packets sent", "transmit_packets"),
    ("mscale_host_network_receive_errors", "receive errors", "receive_errors"),
    ("mscale_host_network_transmit_errors", "transmit errors", "transmit_errors"),
    ("mscale_host_network_receive_drops", "received packets dropped", "receive_drops"),
    ("mscale_host_network_transmit_drops", "outgoing packets dropped", "transmit_drops"),
)


def collect(state: AgentState) -> Iterable[Metric]:
    snap = state.snapshots.get("host")
    if snap is None:
        return
    cpu = CounterMetricFamily("mscale_host_cpu_seconds", "CPU time summed over all CPUs, by mode", labels=["mode"])
    for mode, secs in snap.cpu_seconds:
        cpu.add_metric([mode], secs)
    yield cpu
    yield GaugeMetricFamily("mscale_host_cpus", "logical CPUs", value=snap.cpus)
    yield GaugeMetricFamily("mscale_host_memory_total_bytes", "physical memory", value=snap.memory_total_bytes)
    yield GaugeMetricFamily(
        "mscale_host_memory_available_bytes", "memory available without swapping", value=snap.memory_available_bytes
    )
    yield GaugeMetricFamily(
        "mscale_host_memory_used_bytes", "memory in use (total - available)", value=snap.memory_used_bytes
    )
    for name, help_, field in DISK:
        fam = CounterMetricFamily(name, help_, labels=["device"])
        for d in snap.disks:
            fam.add_metric([d.device], getattr(d, field))
        yield fam
    for name, help_, field in NIC:
        fam = CounterMetricFamily(name, help_, labels=["interface"])
        for n in snap.nics:
            fam.add_metric([n.interface], getattr(n, field))
        yield fam

    pl = ["job_id", "pid"]
    cpu_p = CounterMetricFamily("mscale_process_cpu_seconds", "CPU time of the training process", labels=pl + ["mode"])
    rss = GaugeMetricFamily(
        "mscale_process_resident_memory_bytes", "resident memory of the training process", labels=pl
    )
    rd = CounterMetricFamily("mscale_process_read_bytes", "bytes the training process read from storage", labels=pl)
    wr = CounterMetricFamily("mscale_process_written_bytes", "bytes the training process wrote to storage", labels=pl)
    threads = GaugeMetricFamily("mscale_process_threads", "threads of the training process", labels=pl)
    for p in snap.processes:
        lv = [p.job_id, str(p.pid)]
        cpu_p.add_metric(lv + ["user"], p.cpu_user_s)
        cpu_p.add_metric(lv + ["system"], p.cpu_system_s)
        rss.add_metric(lv, p.rss_bytes)
        if p.read_bytes is not None:
            rd.add_metric(lv, p.read_bytes)
            wr.add_metric(lv, p.written_bytes or 0)
        threads.add_metric(lv, p.threads)
    yield from (cpu_p, rss, rd, wr, threads)

"""Host probe (psutil): CPU, memory, disk I/O per device, network per interface, and the
CPU, RSS and I/O of each registered training process (`ctx.jobs()`, their pids).

`probes.host.proc_root` points psutil at another procfs tree (tests use a fixture). psutil
reads that path from a module global, so a non-default root is set only for the duration
of a sample, under a lock.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from mscale.options import opt
from mscale.probes.base import ProbeContext, ProbeSpec

# Virtual block devices with nothing to say about training I/O.
_SKIP_DISK = re.compile(r"^(loop|ram|zram|fd|sr)\d+$")
_procfs_lock = threading.Lock()


@dataclass(frozen=True)
class DiskSample:
    device: str
    read_bytes: int
    written_bytes: int
    reads: int
    writes: int
    io_time_s: float  # time the device was busy


@dataclass(frozen=True)
class NicSample:
    interface: str
    receive_bytes: int
    transmit_bytes: int
    receive_packets: int
    transmit_packets: int
    receive_errors: int
    transmit_errors: int
    receive_drops: int
    transmit_drops: int


@dataclass(frozen=True)
class ProcessSample:
    job_id: str
    pid: int
    cpu_user_s: float
    cpu_system_s: float
    rss_bytes: int
    read_bytes: int | None  # None without permission to read /proc/PID/io
    written_bytes: int | None
    threads: int


@dataclass(frozen=True)
class HostSnapshot:
    time: float
    cpus: int
    cpu_seconds: tuple[tuple[str, float], ...]  # (mode, seconds) summed over CPUs
    memory_total_bytes: int
    memory_available_bytes: int
    memory_used_bytes: int
    disks: tuple[DiskSample, ...]
    nics: tuple[NicSample, ...]
    processes: tuple[ProcessSample, ...]
    processes_gone: tuple[str, ...] = ()  # job ids whose pid is no longer there


def whole_disks(names: list[str]) -> list[str]:
    """Drop partitions (sda1 of sda, nvme0n1p1 of nvme0n1) and virtual devices."""
    names = [n for n in names if not _SKIP_DISK.match(n)]
    present = set(names)
    out = []
    for n in names:
        m = re.match(r"^(.*?\D)p?\d+$", n)
        if m and (m.group(1) in present or m.group(1).rstrip("p") in present) and m.group(1) != n:
            continue
        out.append(n)
    return sorted(out)


@contextlib.contextmanager
def _procfs(root: str) -> Iterator[None]:
    if root in ("", "/proc"):
        yield
        return
    with _procfs_lock:
        saved = psutil.PROCFS_PATH
        psutil.PROCFS_PATH = root
        try:
            yield
        finally:
            psutil.PROCFS_PATH = saved


class HostProbe:
    name = "host"

    def __init__(
        self,
        *,
        jobs: Callable[[], Sequence[Any]] = list,
        proc_root: str = "/proc",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.jobs, self.proc_root, self.clock = jobs, proc_root, clock
        self._procs: dict[int, psutil.Process] = {}  # kept, so cpu_times stay per process instance

    def _process(self, pid: int) -> psutil.Process:
        p = self._procs.get(pid)
        if p is None or not p.is_running():  # is_running also catches a reused pid
            p = self._procs[pid] = psutil.Process(pid)
        return p

    def _sample_processes(self) -> tuple[tuple[ProcessSample, ...], tuple[str, ...]]:
        out, gone, seen = [], [], set()
        targets = [
            (int(pid or 0), str(getattr(job, "job_id", "")))
            for job in self.jobs()
            for pid in (getattr(job, "pids", None) or [getattr(job, "pid", 0)])  # every live rank
        ]
        for pid, job_id in targets:
            if pid <= 0:
                continue
            seen.add(pid)
            try:
                p = self._process(pid)
                with p.oneshot():
                    cpu = p.cpu_times()
                    rss = p.memory_info().rss
                    threads = p.num_threads()
                    rd: int | None
                    wr: int | None
                    try:
                        io = p.io_counters()
                        rd, wr = io.read_bytes, io.write_bytes
                    except (psutil.AccessDenied, AttributeError):
                        rd = wr = None
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                gone.append(job_id)
                self._procs.pop(pid, None)
                continue
            except psutil.AccessDenied:
                continue
            out.append(ProcessSample(job_id, pid, cpu.user, cpu.system, rss, rd, wr, threads))
        for pid in set(self._procs) - seen:
            del self._procs[pid]
        return tuple(out), tuple(gone)

    def sample(self) -> HostSnapshot:
        with _procfs(self.proc_root):
            cpu = psutil.cpu_times()
            mem = psutil.virtual_memory()
            disks = psutil.disk_io_counters(perdisk=True, nowrap=True) or {}
            nics = psutil.net_io_counters(pernic=True, nowrap=True) or {}
            procs, gone = self._sample_processes()
        return HostSnapshot(
            time=self.clock(),
            cpus=psutil.cpu_count() or 0,
            cpu_seconds=tuple((mode, float(getattr(cpu, mode))) for mode in cpu._fields),
            memory_total_bytes=mem.total,
            memory_available_bytes=mem.available,
            memory_used_bytes=mem.total - mem.available,
            disks=tuple(
                DiskSample(
                    d,
                    disks[d].read_bytes,
                    disks[d].write_bytes,
                    disks[d].read_count,
                    disks[d].write_count,
                    getattr(disks[d], "busy_time", 0) / 1000,
                )
                for d in whole_disks(list(disks))
            ),
            nics=tuple(
                NicSample(
                    n,
                    c.bytes_recv,
                    c.bytes_sent,
                    c.packets_recv,
                    c.packets_sent,
                    c.errin,
                    c.errout,
                    c.dropin,
                    c.dropout,
                )
                for n, c in sorted(nics.items())
            ),
            processes=procs,
            processes_gone=gone,
        )

    def close(self) -> None:
        self._procs.clear()


@dataclass(frozen=True)
class HostProbeSection:
    """[probes.host]"""

    interval_s: float = opt(5.0, "seconds between host samples", min=0.05, max=3600)
    timeout_s: float = opt(5.0, "deadline for one sample", min=0.05, max=600)
    proc_root: str = opt("/proc", "procfs root (tests point it at a fixture tree)")


def _factory(ctx: ProbeContext) -> HostProbe:
    return HostProbe(jobs=ctx.jobs, proc_root=ctx.config.probes.host.proc_root, clock=ctx.clock)


# Needs procfs (read through psutil).
SPEC = ProbeSpec(name="host", factory=_factory, section=HostProbeSection)

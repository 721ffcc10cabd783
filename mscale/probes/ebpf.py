"""eBPF probe: uprobes on the CUDA driver and runtime of every training process, no change
to the job.

Which processes: the jobs registered through the hook library (`ctx.jobs()`, their pids) plus
any whose command line matches `cmdline_pattern`. Each is attached through its own
libcuda (found in /proc/PID/maps, or `libcuda_path`) with a pid filter, and through the
libcudart it maps once it does (PyTorch's, usually): each launch, copy and synchronise
counts once, at the runtime when it came through it, else at the driver. The BPF program
(ebpf_cuda.bpf.c) counts in the kernel; `sample()` reads the maps, judges hangs, sync
stalls and allocation failures, and publishes an immutable `EbpfSnapshot`.

Duty cycle: a kernel uprobe costs a trap per hit, and a training step makes thousands of
launches, so the launch and copy probes are attached for `duty_window_s` every
`duty_period_s` (by a thread of their own) and their counts extrapolated by
period/window. Synchronise and allocation probes stay attached: a thread blocked in a
synchronise call for longer than `hang_timeout_s` is a hang whatever the duty cycle.
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from mscale.findings import Finding, Reason, Severity
from mscale.options import opt
from mscale.probes.base import ProbeContext, ProbeSpec, ProbeUnavailable
from mscale.probes.ebpf_detect import BlockedShare, LaunchWatch
from mscale.probes.ebpf_loader import ROLES, RUNTIME, Link, preflight
from mscale.probes.ebpf_process import CudaProcess, HangCause, Traced
from mscale.probes.ebpf_procfs import Procfs

if TYPE_CHECKING:
    from mscale.probes.ebpf_loader import CudaBpf, InflightSync

log = structlog.get_logger("mscale.probes.ebpf")

SOURCE = "ebpf"
__all__ = ["EbpfProbe", "EbpfSnapshot", "CudaProcess", "HangCause", "PendingProcess", "SPEC"]


# --- the snapshot ------------------------------------------------------------------------


@dataclass(frozen=True)
class PendingProcess:
    pid: int
    job_id: str
    reason: str  # why it is not traced (yet)


@dataclass(frozen=True)
class EbpfSnapshot:
    time: float
    attach_mode: str  # "uprobe_multi" or "perf_event"
    duty_window_s: float
    duty_period_s: float
    sampled: bool  # launch/copy counts are extrapolated from duty windows
    launch_probe_attached: bool
    windows_total: int
    processes: tuple[CudaProcess, ...]
    pending: tuple[PendingProcess, ...]


class EbpfProbe:
    name = SOURCE

    def __init__(self, ctx: ProbeContext, section: EbpfProbeSection, pattern: re.Pattern | None) -> None:
        self.ctx, self.cfg, self.pattern = ctx, section, pattern
        self.procfs = Procfs(section.proc_root)
        self.always_on = section.duty_window_s >= section.duty_period_s
        self.scale = 1.0 if self.always_on else section.duty_period_s / section.duty_window_s
        self.bpf: CudaBpf | None = None
        self._unavailable = ""
        self._lock = threading.RLock()
        self._tracked: dict[int, Traced] = {}
        self._pending: dict[int, PendingProcess] = {}
        self._high_on = False
        self._windows = 0
        self._stop = threading.Event()
        self._duty: threading.Thread | None = None

    @property
    def _bpf(self) -> CudaBpf:
        """The loaded program, for the methods that run only once `_load()` succeeded."""
        if self.bpf is None:
            raise RuntimeError("the BPF program is not loaded")
        return self.bpf

    # lifecycle -----------------------------------------------------------------------
    def _load(self) -> None:
        from mscale.probes.ebpf_loader import CudaBpf

        try:
            bpf = CudaBpf(
                max_pids=self.cfg.max_processes,
                max_threads=self.cfg.max_processes * 64,
                attach_mode=self.cfg.attach_mode,
            )
        except Exception as e:  # compile or load refused: not there, and it will not be
            self._unavailable = f"BPF program failed to load: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            raise ProbeUnavailable(self._unavailable) from None
        with self._lock:
            if self._stop.is_set():  # closed while compiling (the agent stopped at start-up)
                bpf.close()
                raise ProbeUnavailable("the probe was closed while its BPF program loaded")
            self.bpf = bpf
            self._set_high(True)  # the first window opens now: a process tracked next is counted at once
            self._duty = threading.Thread(target=self._duty_loop, name="ebpf-duty-cycle", daemon=True)
            self._duty.start()

    def close(self) -> None:
        with self._lock:  # a _load() in progress sees the stop once its compile ends
            self._stop.set()
        if self._duty is not None:
            self._duty.join(timeout=10)
        with self._lock:
            if self.bpf is not None:
                links = [link for tr in self._tracked.values() for link in tr.rare + tr.high]
                self._tracked.clear()
                self.bpf.close(links)
                self.bpf = None

    def duty_state(self) -> tuple[int, bool]:
        """(windows opened so far, launch/copy probes attached now)."""
        with self._lock:
            return self._windows, self._high_on

    # duty cycle ------------------------------------------------------------------------
    def _duty_loop(self) -> None:
        window, period = self.cfg.duty_window_s, self.cfg.duty_period_s
        start = time.monotonic()  # _load() opened the first window
        if self.always_on:
            return  # attached until close()
        while True:
            if self._stop.wait(max(0.0, start + window - time.monotonic())):
                return
            self._switch(False)
            start += period
            start = max(start, time.monotonic())  # attach/detach slower than the period: skip ahead
            if self._stop.wait(start - time.monotonic()):
                return
            self._switch(True)

    def _switch(self, on: bool) -> None:
        """One window edge; an error is logged, never the end of the thread (a dead duty cycle
        would leave the launch probes attached, at full cost, for the agent's lifetime)."""
        try:
            self._set_high(on)
        except Exception:
            log.error("ebpf_duty_cycle_failed", attach=on, exc_info=True)

    def _set_high(self, on: bool) -> None:
        with self._lock:
            if self.bpf is None:
                return
            if on:
                self._windows += 1
                self._high_on = True
                for tr in self._tracked.values():
                    self._attach_high(tr)
            else:
                t = time.monotonic()  # uprobes go at the start of the detach; the wait follows
                for tr in self._tracked.values():
                    tr.watch.detached(t)
                    self._detach(tr.high)
                self._high_on = False

    def _attach_high(self, tr: Traced) -> None:
        try:
            for role in ROLES:
                path, offsets = tr.targets(role)
                if role.high_rate and offsets:
                    tr.high.append(self._bpf.attach(tr.pid, path, role, offsets))
        except Exception as e:
            tr.error = f"launch/copy probes: {e}"
            log.warning("ebpf_attach_failed", pid=tr.pid, job_id=tr.job_id, error=str(e))
        tr.watch.attached(time.monotonic())

    def _detach(self, links: list[Link]) -> None:
        for link in links:
            try:
                self._bpf.detach(link)
            except Exception:
                log.warning("ebpf_detach_failed", role=link.role.prog, exc_info=True)
        links.clear()

    # targets ---------------------------------------------------------------------------
    def _targets(self) -> dict[int, str]:
        out: dict[int, str] = {}
        for job in self.ctx.jobs():
            for pid in getattr(job, "pids", None) or [getattr(job, "pid", None)]:  # every live rank
                if isinstance(pid, int) and pid > 0:
                    out[pid] = str(getattr(job, "job_id", ""))
        if self.pattern is not None:
            for pid in self.procfs.matching(self.pattern, skip={*out, os.getpid()}):
                out[pid] = ""
        return out

    def _reconcile(self, targets: dict[int, str], now: float) -> None:
        for pid, tr in list(self._tracked.items()):
            start = self.procfs.start_time(pid)
            if pid not in targets or start != tr.start_time:
                self._untrack(tr, "exited" if start != tr.start_time else "no longer a target")
        self._pending = {p: v for p, v in self._pending.items() if p in targets}
        for pid, job_id in targets.items():
            if pid in self._tracked:
                self._tracked[pid].job_id = job_id
                self._find_runtime(self._tracked[pid])
                continue
            start = self.procfs.start_time(pid)
            if start is None:
                self._pend(pid, job_id, "process not running")
                continue
            library = self.cfg.libcuda_path or self.procfs.libcuda(pid)
            if library is None:
                self._pend(
                    pid, job_id, "libcuda not mapped (yet); set probes.ebpf.libcuda_path to attach before it loads"
                )
                continue
            self._track(pid, job_id, start, library, now)
        # entries nobody tracks (a pid reused between two reads): never let the maps grow
        stale = self._bpf.map_pids() - set(self._tracked)
        for pid in stale:
            self._bpf.remove_pid(pid)

    def _pend(self, pid: int, job_id: str, reason: str) -> None:
        old = self._pending.get(pid)
        if old is None or old.reason != reason:
            log.info("ebpf_not_traced", pid=pid, job_id=job_id, reason=reason)
        self._pending[pid] = PendingProcess(pid, job_id, reason)

    def _track(self, pid: int, job_id: str, start: int, library: str, now: float) -> None:
        try:
            offsets = self._bpf.offsets(library)
        except Exception as e:
            self._pend(pid, job_id, f"cannot read symbols of {library}: {e}")
            return
        cfg = self.cfg
        tr = Traced(
            pid,
            job_id,
            start,
            library,
            offsets,
            LaunchWatch(hang_timeout_s=cfg.hang_timeout_s, min_evidence_s=min(cfg.duty_window_s, cfg.duty_period_s)),
            BlockedShare(cfg.sync_stall_window_s),
        )
        self._bpf.add_pid(pid)  # before attaching: the entry is the in-kernel pid filter
        try:
            for role in ROLES:
                path, offs = tr.targets(role)  # the driver's for now; the runtime's once found
                if not role.high_rate and offs:
                    tr.rare.append(self._bpf.attach(pid, path, role, offs))
        except Exception as e:
            self._detach(tr.rare)
            self._bpf.remove_pid(pid)
            self._pend(pid, job_id, f"attach failed: {e}")
            return
        self._pending.pop(pid, None)
        self._tracked[pid] = tr
        if self._high_on:
            self._attach_high(tr)
        log.info("ebpf_attached", pid=pid, job_id=job_id, library=library, mode=self._bpf.attach_mode)
        self._find_runtime(tr)

    def _find_runtime(self, tr: Traced) -> None:
        """Attach to the libcudart the process maps, once it maps one (checked each sample)."""
        if tr.runtime or not self.cfg.runtime_probes:
            return
        path = self.procfs.libcudart(tr.pid)
        if path is None or path == tr.runtime_seen:
            return
        tr.runtime_seen = path
        rare: list[Link] = []
        high: list[Link] = []
        try:
            offsets = self._bpf.offsets(path, RUNTIME)
            for role in ROLES:
                if role.library == RUNTIME and offsets[role.prog] and (self._high_on or not role.high_rate):
                    (high if role.high_rate else rare).append(self._bpf.attach(tr.pid, path, role, offsets[role.prog]))
        except Exception as e:  # all or none (an entry probe without its return would mute the driver's)
            self._detach(rare + high)
            tr.error = f"runtime probes ({path}): {e}"
            log.warning("ebpf_runtime_attach_failed", pid=tr.pid, library=path, error=str(e))
            return
        tr.runtime, tr.rt_offsets = path, offsets
        tr.rare += rare
        tr.high += high
        log.info("ebpf_runtime_attached", pid=tr.pid, job_id=tr.job_id, library=path)

    def _untrack(self, tr: Traced, why: str) -> None:
        self._detach(tr.rare)
        self._detach(tr.high)
        self._bpf.remove_pid(tr.pid)
        del self._tracked[tr.pid]
        labels = {"pid": str(tr.pid), "job_id": tr.job_id}
        if tr.hang_cause:
            self._emit(Reason.TRAINING_HANG_CLEARED, Severity.INFO, f"process {tr.pid} {why} while hung", labels)
        if tr.stall:
            self._emit(Reason.SYNC_STALL_CLEARED, Severity.INFO, f"process {tr.pid} {why}", labels)
        log.info("ebpf_detached", pid=tr.pid, job_id=tr.job_id, why=why)

    # sampling --------------------------------------------------------------------------
    def sample(self) -> EbpfSnapshot:
        if self._unavailable:
            raise ProbeUnavailable(self._unavailable)
        if self.bpf is None:
            self._load()
        with self._lock:
            now = time.monotonic()
            self._reconcile(self._targets(), now)
            counters = self._bpf.read_stats()
            inflight: dict[int, list[InflightSync]] = {}
            for e in self._bpf.read_inflight():
                if e.pid not in self._tracked or not self.procfs.thread_alive(e.pid, e.tid):
                    self._bpf.forget_thread(e.pid << 32 | e.tid)  # the thread died inside the call
                    continue
                inflight.setdefault(e.pid, []).append(e)
            procs = tuple(
                tr.update(
                    counters.get(pid), inflight.get(pid, []), now, scale=self.scale, limits=self.cfg, emit=self._emit
                )
                for pid, tr in sorted(self._tracked.items())
            )
            return EbpfSnapshot(
                time=self.ctx.clock(),
                attach_mode=self._bpf.attach_mode,
                duty_window_s=self.cfg.duty_window_s,
                duty_period_s=self.cfg.duty_period_s,
                sampled=not self.always_on,
                launch_probe_attached=self._high_on,
                windows_total=self._windows,
                processes=procs,
                pending=tuple(self._pending[p] for p in sorted(self._pending)),
            )

    def _emit(self, reason: Reason, severity: Severity, message: str, labels: dict[str, str]) -> None:
        self.ctx.emit(Finding(SOURCE, reason, severity, message, labels, self.ctx.clock()))


@dataclass(frozen=True)
class EbpfProbeSection:
    """[probes.ebpf]"""

    interval_s: float = opt(1.0, "seconds between reads of the BPF maps", min=0.05, max=3600)
    timeout_s: float = opt(
        30.0, "deadline for one read (the first includes compiling the BPF program)", min=0.05, max=600
    )
    libcuda_path: str = opt("", "path of libcuda.so.1 (empty: found per process from /proc/PID/maps)")
    proc_root: str = opt("/proc", "procfs root (tests point it at a fixture tree)")
    runtime_probes: bool = opt(
        True,
        "also probe the libcudart a process maps, counting each launch once (three uprobe hits per "
        "runtime launch in a window instead of one; docs/ebpf.md); false: the driver's entry points only",
    )
    cmdline_pattern: str = opt(
        "", "regex: also trace processes whose command line matches (empty: registered jobs only)"
    )
    hang_timeout_s: float = opt(
        60.0, "no kernel launch, or one sync call blocked, for this long is a hang", min=0.1, max=86400
    )
    sync_stall_ratio: float = opt(
        0.5, "share of wall time blocked in synchronise calls that is a sync stall", min=0.01, max=1.0
    )
    sync_stall_window_s: float = opt(30.0, "window over which the sync-stall share is measured", min=0.5, max=3600)
    duty_window_s: float = opt(0.5, "high-rate probes (launch, copy) stay attached this long ...", min=0.01, max=3600)
    duty_period_s: float = opt(
        10.0, "... once every this many seconds (equal to the window: always on)", min=0.01, max=3600
    )
    max_processes: int = opt(256, "processes traced at once (sizes the BPF maps)", min=1, max=65536)
    attach_mode: str = opt(
        "auto",
        "how uprobes are attached: uprobe_multi links (Linux 6.6+, fast to detach), "
        "perf_event (one per symbol), or auto (the first that works)",
        choices=("auto", "uprobe_multi", "perf_event"),
    )


def make(ctx: ProbeContext) -> EbpfProbe:
    section = ctx.config.probes.ebpf
    if section.libcuda_path and not os.path.isfile(section.libcuda_path):
        raise ProbeUnavailable(f"probes.ebpf.libcuda_path {section.libcuda_path!r} does not exist")
    try:
        pattern = re.compile(section.cmdline_pattern) if section.cmdline_pattern else None
    except re.error as e:
        raise ProbeUnavailable(f"probes.ebpf.cmdline_pattern is not a valid regular expression: {e}") from None
    preflight()
    return EbpfProbe(ctx, section, pattern)


# Needs BCC (python3-bpfcc), kernel headers, CAP_BPF + CAP_PERFMON + CAP_SYS_RESOURCE.
SPEC = ProbeSpec(
    SOURCE,
    make,
    section=EbpfProbeSection,
    default_enabled=True,
    enabled_help="run the eBPF CUDA-driver probe (needs BCC and CAP_BPF/CAP_PERFMON)",
)

"""eBPF probe: uprobes on the CUDA driver and runtime of every training process, no change
to the job.

Which processes: the jobs registered through the hook library (`state.jobs[*].pid`) plus
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
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

import structlog

from mscale.findings import Finding, Reason, Severity
from mscale.options import opt
from mscale.probes.base import ProbeContext, ProbeSpec, ProbeUnavailable
from mscale.probes.ebpf_detect import BlockedShare, LaunchWatch
from mscale.probes.ebpf_loader import DIRECTIONS, HIST_SLOTS, ROLES, RUNTIME, Link, PidCounters, Role, preflight

if TYPE_CHECKING:
    from mscale.probes.ebpf_loader import CudaBpf, InflightSync

log = structlog.get_logger("mscale.probes.ebpf")

SOURCE = "ebpf"
_LIBCUDA = re.compile(r"/libcuda\.so(\.\d+)*$")
_LIBCUDART = re.compile(r"/libcudart\.so(\.\d+)*$")
_ZERO = PidCounters(0, 0, 0, (0,) * len(DIRECTIONS), (0,) * len(DIRECTIONS), 0, 0, 0, 0, 0, 0, (0,) * HIST_SLOTS)


# --- the snapshot ------------------------------------------------------------------------


class HangCause(StrEnum):
    """Why a process counts as hung: the `cause` label of a training_hang finding."""

    SYNC_BLOCKED = "sync_blocked"  # a synchronising call (stream, device, event) blocked too long
    NO_LAUNCH = "no_launch"  # no kernel launched for too long while the process was observed


@dataclass(frozen=True)
class CudaProcess:
    pid: int
    job_id: str  # "" for a process traced by cmdline_pattern only
    library: str
    launches: float  # extrapolated by period/window; exact when always on
    launches_observed: int
    graph_launches: float
    graph_launches_observed: int
    memcpy_bytes: tuple[tuple[str, float], ...]  # (direction, bytes), extrapolated
    memcpy_bytes_observed: tuple[tuple[str, int], ...]
    sync_calls: int
    sync_seconds_sum: float
    sync_hist: tuple[int, ...]  # sync_hist[s]: calls that took [2^(s-1), 2^s) ns
    sync_inflight_s: float  # longest synchronise call in flight now (0: none)
    sync_blocked_ratio: float | None  # over sync_stall_window_s; None until a window is seen
    alloc_failures: int
    hang: bool
    hang_cause: str  # a HangCause, or "" while not hung
    launch_quiet_s: float | None  # since the last launch seen; None: never seen one
    sync_stall: bool
    error: str = ""  # a probe that could not attach (the others still count)
    runtime_library: str = ""  # the libcudart attached too ("": none mapped, driver only)


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


# --- one traced process --------------------------------------------------------------------


@dataclass
class _Tracked:
    pid: int
    job_id: str
    start_time: int  # /proc/PID/stat starttime: a reused pid is another process
    library: str
    offsets: dict[str, list[int]]
    watch: LaunchWatch
    share: BlockedShare
    rare: list[Link] = field(default_factory=list)
    high: list[Link] = field(default_factory=list)
    last: PidCounters = _ZERO
    launches: float = 0.0
    graph_launches: float = 0.0
    copy_bytes: list[float] = field(default_factory=lambda: [0.0] * len(DIRECTIONS))
    hang_cause: str = ""
    stall: bool = False
    error: str = ""
    runtime: str = ""  # libcudart, once mapped and attached
    rt_offsets: dict[str, list[int]] = field(default_factory=dict)
    runtime_seen: str = ""  # the libcudart last tried (not retried on every sample)

    def targets(self, role: Role) -> tuple[str, list[int]]:
        """(library path, offsets) of a role in this process; no offsets: not attached."""
        if role.library == RUNTIME:
            return self.runtime, self.rt_offsets.get(role.prog, []) if self.runtime else []
        return self.library, self.offsets.get(role.prog, [])


def _proc_start(pid: int) -> int | None:
    """starttime of a live process, None if gone or a zombie."""
    try:
        stat = open(f"/proc/{pid}/stat", "rb").read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def find_libcuda(pid: int) -> str | None:
    """The libcuda a process has mapped, as a path that reaches the same file from here."""
    return find_library(pid, _LIBCUDA)


def find_libcudart(pid: int) -> str | None:
    """The CUDA runtime a process has mapped (none when it links it statically)."""
    return find_library(pid, _LIBCUDART)


def find_library(pid: int, name: re.Pattern) -> str | None:
    try:
        maps = open(f"/proc/{pid}/maps").read()
    except OSError:
        return None
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or not name.search(parts[5]):
            continue
        path, inode = parts[5], int(parts[4])
        try:
            if os.stat(path).st_ino == inode:
                return path
        except OSError:
            pass
        return f"/proc/{pid}/root{path}"  # another mount namespace (a container)
    return None


class EbpfProbe:
    name = SOURCE

    def __init__(self, ctx: ProbeContext, section: EbpfProbeSection, pattern: re.Pattern | None) -> None:
        self.ctx, self.cfg, self.pattern = ctx, section, pattern
        self.always_on = section.duty_window_s >= section.duty_period_s
        self.scale = 1.0 if self.always_on else section.duty_period_s / section.duty_window_s
        self.bpf: CudaBpf | None = None
        self._unavailable = ""
        self._lock = threading.RLock()
        self._tracked: dict[int, _Tracked] = {}
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
            self._set_high(False)
            start += period
            start = max(start, time.monotonic())  # attach/detach slower than the period: skip ahead
            if self._stop.wait(start - time.monotonic()):
                return
            self._set_high(True)

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

    def _attach_high(self, tr: _Tracked) -> None:
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
        for job in list(self.ctx.state.jobs.values()):
            for pid in getattr(job, "pids", None) or [getattr(job, "pid", None)]:  # every live rank
                if isinstance(pid, int) and pid > 0:
                    out[pid] = str(getattr(job, "job_id", ""))
        if self.pattern is not None:
            me = os.getpid()
            for entry in os.listdir("/proc"):
                if not entry.isdigit() or int(entry) in out or int(entry) == me:
                    continue
                try:
                    cmdline = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                if cmdline and self.pattern.search(cmdline.strip()):
                    out[int(entry)] = ""
        return out

    def _reconcile(self, targets: dict[int, str], now: float) -> None:
        for pid, tr in list(self._tracked.items()):
            start = _proc_start(pid)
            if pid not in targets or start != tr.start_time:
                self._untrack(tr, "exited" if start != tr.start_time else "no longer a target")
        self._pending = {p: v for p, v in self._pending.items() if p in targets}
        for pid, job_id in targets.items():
            if pid in self._tracked:
                self._tracked[pid].job_id = job_id
                self._find_runtime(self._tracked[pid])
                continue
            start = _proc_start(pid)
            if start is None:
                self._pend(pid, job_id, "process not running")
                continue
            library = self.cfg.libcuda_path or find_libcuda(pid)
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
        tr = _Tracked(
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

    def _find_runtime(self, tr: _Tracked) -> None:
        """Attach to the libcudart the process maps, once it maps one (checked each sample)."""
        if tr.runtime or not self.cfg.runtime_probes:
            return
        path = find_libcudart(tr.pid)
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

    def _untrack(self, tr: _Tracked, why: str) -> None:
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
                if e.pid not in self._tracked or not os.path.exists(f"/proc/{e.pid}/task/{e.tid}"):
                    self._bpf.forget_thread(e.pid << 32 | e.tid)  # the thread died inside the call
                    continue
                inflight.setdefault(e.pid, []).append(e)
            procs = tuple(
                self._update(tr, counters.get(pid), inflight.get(pid, []), now)
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

    def _update(self, tr: _Tracked, c: PidCounters | None, inflight: list[InflightSync], now: float) -> CudaProcess:
        c = c or tr.last
        prev, tr.last = tr.last, c
        tr.launches += (c.launches - prev.launches) * self.scale
        tr.graph_launches += (c.graph_launches - prev.graph_launches) * self.scale
        for i in range(len(DIRECTIONS)):
            tr.copy_bytes[i] += (c.copy_bytes[i] - prev.copy_bytes[i]) * self.scale
        if (c.launches, c.graph_launches) != (prev.launches, prev.graph_launches) and c.last_launch_ns:
            tr.watch.launched(c.last_launch_ns / 1e9)
        blocked = [max(0.0, now - e.entered_ns / 1e9) for e in inflight]
        longest = max(blocked, default=0.0)
        tr.share.add(now, c.sync_ns / 1e9 + sum(blocked))
        ratio = tr.share.ratio()
        labels = {"pid": str(tr.pid), "job_id": tr.job_id}
        cfg = self.cfg

        cause = ""
        if longest > cfg.hang_timeout_s:
            cause = HangCause.SYNC_BLOCKED
        elif tr.watch.hung(now):
            cause = HangCause.NO_LAUNCH
        if cause and not tr.hang_cause:
            if cause == HangCause.SYNC_BLOCKED:
                kinds = sorted({e.kind for e in inflight})
                msg = f"process {tr.pid} blocked in {', '.join(kinds)} for {longest:.1f}s (> {cfg.hang_timeout_s:g}s)"
            else:
                msg = (
                    f"process {tr.pid} launched no kernel for {tr.watch.quiet_s(now):.1f}s "
                    f"(> {cfg.hang_timeout_s:g}s, {tr.watch.evidence_s(now):.1f}s of it observed)"
                )
            self._emit(Reason.TRAINING_HANG, Severity.CRITICAL, msg, {**labels, "cause": cause})
        elif tr.hang_cause and not cause:
            self._emit(
                Reason.TRAINING_HANG_CLEARED,
                Severity.INFO,
                f"process {tr.pid} is launching kernels again",
                {**labels, "cause": tr.hang_cause},
            )
        tr.hang_cause = cause

        if ratio is not None and (ratio > cfg.sync_stall_ratio) != tr.stall:
            tr.stall = not tr.stall
            if tr.stall:
                self._emit(
                    Reason.SYNC_STALL,
                    Severity.WARNING,
                    f"process {tr.pid} blocked in synchronise calls {ratio:.0%} of the last "
                    f"{cfg.sync_stall_window_s:g}s (> {cfg.sync_stall_ratio:.0%})",
                    labels,
                )
            else:
                self._emit(
                    Reason.SYNC_STALL_CLEARED,
                    Severity.INFO,
                    f"process {tr.pid} blocked in synchronise calls {ratio:.0%} of the last "
                    f"{cfg.sync_stall_window_s:g}s",
                    labels,
                )

        failed = c.alloc_failures - prev.alloc_failures
        if failed > 0:
            self._emit(
                Reason.CUDA_ALLOC_FAILURE,
                Severity.WARNING,
                f"process {tr.pid}: {failed} cuMemAlloc call(s) failed, the latest for "
                f"{c.last_alloc_fail_bytes} bytes with CUresult {c.last_alloc_error}",
                {**labels, "bytes": str(c.last_alloc_fail_bytes), "cuda_error": str(c.last_alloc_error)},
            )

        return CudaProcess(
            pid=tr.pid,
            job_id=tr.job_id,
            library=tr.library,
            launches=tr.launches,
            launches_observed=c.launches,
            graph_launches=tr.graph_launches,
            graph_launches_observed=c.graph_launches,
            memcpy_bytes=tuple(zip(DIRECTIONS, tr.copy_bytes, strict=True)),
            memcpy_bytes_observed=tuple(zip(DIRECTIONS, c.copy_bytes, strict=True)),
            sync_calls=c.sync_calls,
            sync_seconds_sum=c.sync_ns / 1e9,
            sync_hist=c.sync_hist,
            sync_inflight_s=longest,
            sync_blocked_ratio=ratio,
            alloc_failures=c.alloc_failures,
            hang=bool(cause),
            hang_cause=cause,
            launch_quiet_s=tr.watch.quiet_s(now),
            sync_stall=tr.stall,
            error=tr.error,
            runtime_library=tr.runtime,
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
